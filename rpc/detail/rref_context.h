#pragma once
// RRef bookkeeping on one worker: the RRefs it owns, the forks of them that users hold, and the
// user RRefs it holds.
//
// Note [RRef protocol]
// ~~~~~~~~~~~~~~~~~~~~
// (PyTorch's protocol, docs/rpc.md has the diagrams.) An RRef has one owner, the worker that
// holds the value in an OwnerRRef, and any number of users, each holding a UserRRef. Every
// UserRRef is one *fork*, named by a ForkId that is unique across the job; an RRefId names the
// RRef. The owner keeps the set of forks it knows for each of its RRefs (`forks_`) and keeps the
// OwnerRRef in `owners_` while that set is not empty. The value is freed when the OwnerRRef is
// gone: no fork left and no RRef<T> handle left on the owner.
//
// Creating: remote(B, f) on A makes a UserRRef (new RRefId, new ForkId) at once and sends
// REMOTE_CALL carrying both; B gets or creates the OwnerRRef, adds the fork, runs f, stores the
// value (or the error) and answers. A's UserRRef is *pending* (held by `pending_users_`, so it
// cannot be deleted) until that answer confirms it.
//
// Sharing (a fork): when worker P (the parent) sends an RRef to worker C (the child) as an
// argument or a result, P writes fork data {owner, RRefId, new ForkId, parent P}.
//   - P is the owner: P adds the ForkId to `forks_` before sending (early registration), so the
//     owner knows the child before the child exists. C's UserRRef is confirmed at once.
//   - P is a user: P keeps its own UserRRef alive in `pending_children_` until C accepts. C
//     holds its new UserRRef pending, sends RREF_FORK_REQUEST to the owner, and once the owner
//     has added the fork and answered, confirms it and sends RREF_CHILD_ACCEPT to P, which drops
//     the pending child. When the FORK_REQUEST fails (an error, a timeout: the owner may still
//     get it later) C sends nothing to P and its UserRRef stays pending for good, as in
//     PyTorch: P then never lets go, so the owner can never free a value that C may hold; the
//     cost is a leak, reported at shutdown.
//   - C is the owner itself: it uses its OwnerRRef; if P was a user it sends RREF_CHILD_ACCEPT
//     to P; if P is C (the owner sent it to itself) it removes the fork it added while sending.
// Deleting: when the last RRef<T> handle of a UserRRef goes, the user sends RREF_USER_DELETE
// {RRefId, ForkId} to the owner, which removes the fork; an OwnerRRef whose fork set becomes
// empty leaves `owners_` once its value is set. The deletion is sent from a worker thread,
// never from the thread that dropped the handle (that may be a connection's reader, which
// must not write). A graceful shutdown deletes the UserRRefs still held (delete_all_users).
//
// Invariants this gives:
//   1. The owner learns of every fork before it can learn of that fork's deletion: a pending
//      UserRRef cannot be deleted, and a user is confirmed only after the owner added its fork.
//   2. A parent's fork outlives the registration of its child: the parent stays in
//      `pending_children_` until the child's fork is confirmed, so the owner's fork set never
//      drops to empty while a child is on its way.
//   3. Control messages are idempotent: adding a fork twice, deleting an unknown fork and
//      accepting an unknown child change nothing, so a repeated message is harmless.
//   4. Every call through a UserRRef (to_here, rpc_sync/rpc_async/remote on it) keeps the handle
//      alive until its answer arrives, so a delete cannot overtake a call on the same RRef.
//      A call the owner makes on its own RRef carries a *phantom* fork, added before sending and
//      removed by the handler once it holds the OwnerRRef, for the same reason.
//   5. A fork request or fetch may reach the owner before the REMOTE_CALL that creates the value
//      (different connections, a thread pool). The owner tells "not created yet" from "deleted"
//      by the id: an RRefId made on the owner itself that is not in `owners_` is gone, and a
//      request naming it fails at once. For an id made elsewhere the creating call may still
//      be on its way: the request waits on a placeholder in `unborn_` (not in `owners_`), which
//      the creating call adopts; a placeholder the call has not adopted within rpc_timeout is
//      dropped and its requests fail. No request ever creates an owner entry.
//   6. A peer cannot touch what is not its own: the owner records which worker holds each fork
//      (the caller of REMOTE_CALL, the sender of FORK_REQUEST, the destination of a fork the
//      owner sent) and ignores a RREF_USER_DELETE from any other worker, a FORK_REQUEST for a
//      fork another worker holds, and a RREF_CHILD_ACCEPT from a worker the child was not sent
//      to. Requests waiting on placeholders (invariant 5) are bounded per requesting worker
//      (kMaxParkedPerPeer); beyond that they fail at once, so bogus ids cost no memory.
//   7. A peer reaches only what it was given: a REMOTE_CALL (or RREF_METHOD_REMOTE) creates
//      only an RRef id and a fork id made by its sender, and only an id not registered here
//      (ids are a predictable {creator, counter}: otherwise a worker could squat another's next
//      id, or hijack a live RRef). A FETCH or METHOD_CALL is answered only for a worker that
//      holds a fork of the target (checked once the target's value exists, so after the
//      creating call added the creator's fork), or for the owner itself. A child's
//      FORK_REQUEST is registered on the connection's reader thread, before the requests read
//      after it are dispatched, so the child's own FETCH cannot overtake it.
//   8. Only a worker that was given an RRef can become its holder: every RRef has a secret, 128
//      random bits made by its creator (the remote() caller, which sends it in REMOTE_CALL /
//      RREF_METHOD_REMOTE, or the owner for an RRef it made itself), known to the owner and
//      carried in every fork's data. A FORK_REQUEST must present it, and an RRef sent back to
//      its owner must carry it (checked once the owner is registered): a fork id made up by a
//      worker that was never sent the RRef (ids are predictable) is refused, and the RRef is not
//      held (before, the sender became a holder and could fetch the value). The secret travels
//      in the clear inside the job's authenticated connections, like the values themselves.
// Graceful shutdown (agent.h) waits until no control message is in flight anywhere; what is
// still registered then is leaked (a handle kept past shutdown) and is reported.
//
// Thread safety: RRefContext is internally synchronized; it never holds its mutex while sending
// or while an RRef is destroyed.

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "tdist/rpc/registry.h"
#include "tdist/rpc/types.h"

namespace tdist::rpc {

class RpcAgent;

namespace detail {

class RRefContext;

// An RRef's secret (Note [RRef protocol] invariant 8).
struct RRefSecret {
  uint64_t hi = 0;
  uint64_t lo = 0;
  static RRefSecret random();  // from the kernel (getrandom)
  // Compared in constant time.
  bool matches(const RRefSecret& other) const;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(hi, lo);
  }
};

// What travels when an RRef is sent (Note [RRef protocol]).
struct ForkData {
  int32_t owner = -1;
  RRefId rref_id;
  ForkId fork_id;
  int32_t parent = -1;
  uint64_t type_hash = 0;
  std::string type_name;
  RRefSecret secret;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(owner, rref_id, fork_id, parent, type_hash, type_name, secret);
  }
};

// This worker's view of one RRef, shared by all RRef<T> handles of it here.
class RRefBase {
 public:
  RRefBase(std::weak_ptr<RRefContext> ctx, RRefId id, int owner, const TypeInfo* type)
      : ctx_(std::move(ctx)), id_(id), owner_(owner), type_(type) {}
  virtual ~RRefBase() = default;
  RRefBase(const RRefBase&) = delete;
  RRefBase& operator=(const RRefBase&) = delete;

  virtual bool is_owner() const = 0;
  virtual bool confirmed() const = 0;
  const RRefId& id() const { return id_; }
  int owner() const { return owner_; }
  // The agent this RRef belongs to; throws Error when it has shut down.
  std::shared_ptr<RpcAgent> agent() const;
  std::shared_ptr<RRefContext> context() const { return ctx_.lock(); }
  // The value's type as the creator declared it (nullptr for an owner placeholder).
  const TypeInfo* declared_type() const { return type_; }
  // The best known type: the value's once an owner has it, else the declared one.
  virtual const TypeInfo* type() const { return type_; }

 protected:
  const std::weak_ptr<RRefContext> ctx_;
  const RRefId id_;
  const int owner_;
  const TypeInfo* const type_;
};

// The owner's RRef: holds the value, which may arrive later (a running remote call).
class OwnerRRef : public RRefBase {
 public:
  using RRefBase::RRefBase;
  bool is_owner() const override { return true; }
  bool confirmed() const override { return true; }
  const TypeInfo* type() const override;

  // The first of set_value / set_error wins; waiters run on the calling thread.
  void set_value(AnyValue v);
  void set_error(std::exception_ptr e);
  bool ready() const;
  // Runs fn once the value or error is set (at once, here, when it already is).
  void when_ready(std::function<void()> fn);
  // Waits up to `timeout` (0: no limit) for the value; rethrows a stored error; TimeoutError
  // naming the RRef otherwise.
  AnyValue wait(Millis timeout) const;
  // The value or error, once ready.
  AnyValue value() const;
  // Forgets the waiters without running them (their context is going away). A waiter may hold
  // this OwnerRRef itself (a method call waiting for its target), so without this a value that
  // never came would keep the two, and what the waiter holds, alive for ever.
  void drop_waiters();

  // The RRef's secret (invariant 8): random for an RRef made here; the creating call sets its
  // creator's before the owner is registered. Set and read under the RRefContext's mutex.
  const RRefSecret& secret() const { return secret_; }
  void set_secret(const RRefSecret& s) { secret_ = s; }

 private:
  // set_value (no error) and set_error: the first call sets the result and runs the waiters.
  void finish(AnyValue v, std::exception_ptr e);

  RRefSecret secret_ = RRefSecret::random();
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool ready_ = false;                          // guarded by mu_
  AnyValue value_;                              // guarded by mu_
  std::exception_ptr error_;                    // guarded by mu_
  std::vector<std::function<void()>> waiters_;  // guarded by mu_
};

// A user's RRef: one fork. Its destruction tells the owner.
class UserRRef : public RRefBase {
 public:
  UserRRef(std::shared_ptr<RRefContext> ctx, RRefId id, ForkId fork, int owner,
           const TypeInfo* type, RRefSecret secret);
  ~UserRRef() override;
  bool is_owner() const override { return false; }
  bool confirmed() const override { return confirmed_.load(); }
  const ForkId& fork_id() const { return fork_; }
  const RRefSecret& secret() const { return secret_; }
  // The error of the remote() call that created this RRef, if any.
  std::exception_ptr creation_error() const;

 private:
  friend class RRefContext;
  // Keeps the context (and so the means to send the deletion) alive as long as any user is.
  const std::shared_ptr<RRefContext> strong_ctx_;
  const ForkId fork_;
  const RRefSecret secret_;
  std::atomic<bool> confirmed_{false};
  std::atomic<bool> deleted_{false};  // the owner was told (at most once)
  mutable std::mutex mu_;
  std::exception_ptr creation_error_;  // guarded by mu_
};

class RRefContext : public std::enable_shared_from_this<RRefContext> {
 public:
  static constexpr size_t kMaxParkedPerPeer = 256;

  RRefContext(std::weak_ptr<RpcAgent> agent, int rank);
  // Drops the waiters of every owner still without a value (OwnerRRef::drop_waiters).
  ~RRefContext();

  int rank() const { return rank_; }
  std::shared_ptr<RpcAgent> agent() const { return agent_.lock(); }
  GloballyUniqueId new_id();

  // An OwnerRRef for a value created here (an RRef to a local value, or remote() to self).
  // `registered`: enter it in owners_ now (remote() to self, whose call looks it up by id).
  std::shared_ptr<OwnerRRef> create_owner(const TypeInfo* type, bool registered);
  // The OwnerRRef that a request from rank `from` names (a fetch, a method call, an RRef sent
  // back to its owner): the registered one; nullptr when unknown and made here (deleted);
  // otherwise a placeholder that the creating call adopts or that fails after rpc_timeout
  // (invariant 5). InvalidArgument when `from` already has kMaxParkedPerPeer requests waiting
  // on placeholders (invariant 6).
  std::shared_ptr<OwnerRRef> find_owner(const RRefId& id, const TypeInfo* type, int from);
  // The OwnerRRef of the call that creates it (REMOTE_CALL, RREF_METHOD_REMOTE) with its
  // creator's `secret`: registers it, adopting a placeholder that requests already wait on.
  std::shared_ptr<OwnerRRef> create_owner_for_call(const RRefId& id, const RRefSecret& secret);
  // RREF_FORK_REQUEST: adds the fork once the RRef is known here and calls done(nullptr), or
  // calls done(error) when it is unknown (see find_owner). `done` may run later, on another
  // thread.
  // `holder`: the requesting worker, which holds the fork from then on (invariant 6), if the
  // `secret` it presents is the RRef's (invariant 8; else done(InvalidArgument)).
  void add_fork_when_known(const RRefId& id, const ForkId& fork, int holder,
                           const RRefSecret& secret, std::function<void(std::exception_ptr)> done);
  // A pending UserRRef for remote(owner, ...) from here.
  std::shared_ptr<UserRRef> create_user_for_remote(int owner, const TypeInfo* type);
  // The owner answered the REMOTE_CALL / FORK_REQUEST (error: the remote call failed, or the
  // message may not have arrived). Either way the user stops being pending.
  // `confirmed`: the owner registered the fork (even if the call then failed).
  void finish_pending_user(const ForkId& fork, bool confirmed, std::exception_ptr error);
  // The FORK_REQUEST of a child fork failed: the fork stays pending (Note [RRef protocol]).
  void fork_request_failed(const ForkId& fork, std::exception_ptr error);

  // Sender side of a fork to worker `dest` (Note [RRef protocol]).
  ForkData prepare_child_fork(const std::shared_ptr<RRefBase>& rref, int dest);
  // Receiver side: the RRef that fork data from `from` stands for here, of type `type` (checked
  // against the fork data by the caller).
  std::shared_ptr<RRefBase> rref_from_fork(const ForkData& fd, int from, const TypeInfo* type);

  // Owner side (idempotent). `holder`: the worker that holds the fork; only it may delete it.
  // add_fork of a fork already held by another worker, and delete_fork by a worker that does
  // not hold it, change nothing and return false (invariant 6).
  bool add_fork(const RRefId& id, const ForkId& fork, int holder);
  bool delete_fork(const RRefId& id, const ForkId& fork, int holder);
  // REMOTE_CALL / RREF_METHOD_REMOTE from rank `from` creating `id` with the user fork `fork`
  // (none: created_on < 0): InvalidArgument unless both were made by `from` and `id` is new
  // here (remote() to ourselves registered it first: from == rank()). Invariant 7.
  void check_new_rref(const RRefId& id, const ForkId& fork, int from) const;
  // Whether worker `rank` holds a fork of the RRef `id` owned here (invariant 7).
  bool holds_fork(const RRefId& id, int rank) const;
  // The owner's value was just set: leave owners_ when no fork is left.
  void owner_ready(const RRefId& id);
  // Parent side (idempotent): only the worker the child fork was sent to may accept it.
  bool child_accepted(const ForkId& fork, int from);

  // From ~UserRRef.
  void user_deleted(UserRRef& user);
  // Graceful shutdown: sends the deletion of every UserRRef held here that is neither pending
  // nor the parent of a pending child (the handles stay, naming nothing), and drops from
  // `owners_` the owned RRefs with a value and no fork (local handles keep their values).
  // Returns how many deletions it sent.
  size_t delete_all_users();

  // Descriptions of what is still registered: owned RRefs with forks, live user RRefs, pending
  // users and children. Empty when nothing leaked.
  std::vector<std::string> registered() const;
  // Counts for tests and shutdown.
  size_t num_owned() const;
  size_t num_forks(const RRefId& id) const;
  size_t num_pending() const;
  // Placeholders of RRefs not created yet, and the requests waiting on them (invariant 6).
  size_t num_unborn() const;
  size_t num_parked() const;

 private:
  // Requests waiting for an RRef made elsewhere whose creating call has not arrived.
  struct Unborn {
    std::shared_ptr<OwnerRRef> owner;                 // adopted by the creating call
    std::vector<std::function<void(bool)>> on_birth;  // true: created; false: given up
    std::vector<int> parked_by;                       // one entry per waiting request
  };
  void send_fork_request(const std::shared_ptr<UserRRef>& user, int parent);
  void send_child_accept(int parent, const ForkId& fork);
  void send_user_delete(int owner, const RRefId& id, const ForkId& fork);
  // The placeholder for `id` (mu_ held); schedules its expiry when new.
  Unborn& unborn_locked(const RRefId& id, const TypeInfo* type, int from, bool& created);
  // Forgets the requests that waited on `u` (mu_ held).
  void unpark_locked(const Unborn& u);
  void schedule_expiry(const RRefId& id);
  void expire_unborn(const RRefId& id);
  std::exception_ptr unknown_error(const RRefId& id, bool waited) const;
  std::exception_ptr foreign_fork_error(const RRefId& id, const ForkId& fork, int holder) const;
  std::exception_ptr wrong_secret_error(const RRefId& id, const ForkId& fork, int holder) const;
  // Whether `secret` is the secret of the registered owner `id` (mu_ held; false if unknown).
  bool secret_matches_locked(const RRefId& id, const RRefSecret& secret) const;
  bool add_fork_locked(const RRefId& id, const ForkId& fork, int holder);  // mu_ held

  const std::weak_ptr<RpcAgent> agent_;
  const int rank_;
  std::atomic<int64_t> next_id_{0};

  mutable std::mutex mu_;
  std::unordered_map<RRefId, std::shared_ptr<OwnerRRef>, GloballyUniqueIdHash> owners_;
  // The forks of each owned RRef, with the rank that holds each.
  std::unordered_map<RRefId, std::map<ForkId, int>, GloballyUniqueIdHash> forks_;
  std::unordered_map<ForkId, std::shared_ptr<UserRRef>, GloballyUniqueIdHash> pending_users_;
  struct PendingChild {
    std::shared_ptr<RRefBase> parent;  // kept alive until the child accepts
    int dest = -1;                     // the worker the child fork was sent to
  };
  std::unordered_map<ForkId, PendingChild, GloballyUniqueIdHash> pending_children_;
  // Live user RRefs here: for the leak report ("RRef id of type T owned by rank") and for
  // delete_all_users.
  struct LiveUser {
    std::weak_ptr<UserRRef> user;
    std::string what;
  };
  std::unordered_map<ForkId, LiveUser, GloballyUniqueIdHash> users_;
  std::unordered_map<RRefId, Unborn, GloballyUniqueIdHash> unborn_;
  std::unordered_map<int, size_t> parked_;  // requests waiting in unborn_, per requesting rank
};

}  // namespace detail
}  // namespace tdist::rpc
