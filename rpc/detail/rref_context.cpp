#include "tdist/rpc/detail/rref_context.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "tdist/core/logging.h"
#include "tdist/rpc/agent.h"

namespace tdist::rpc::detail {

// ---- RRefSecret (Note [RRef protocol] invariant 8) ----

RRefSecret RRefSecret::random() {
  uint64_t words[2];
  auto* p = reinterpret_cast<char*>(words);
  size_t left = sizeof(words);
  while (left > 0) {
    const ssize_t n = ::getrandom(p, left, 0);
    if (n < 0 && errno == EINTR) continue;
    TDIST_CHECK(n > 0, "getrandom failed: ", std::strerror(errno));
    p += n;
    left -= static_cast<size_t>(n);
  }
  return RRefSecret{words[0], words[1]};
}

bool RRefSecret::matches(const RRefSecret& other) const {
  return ((hi ^ other.hi) | (lo ^ other.lo)) == 0;  // no early exit
}

std::shared_ptr<RpcAgent> RRefBase::agent() const {
  auto ctx = ctx_.lock();
  std::shared_ptr<RpcAgent> a = ctx ? ctx->agent() : nullptr;
  if (!a || a->is_shut_down()) {
    throw Error(str("the RPC agent of the RRef ", id_.str(), " is shut down"));
  }
  return a;
}

// ---- OwnerRRef ----

void OwnerRRef::set_value(AnyValue v) { finish(std::move(v), nullptr); }

void OwnerRRef::set_error(std::exception_ptr e) { finish(AnyValue(), std::move(e)); }

void OwnerRRef::finish(AnyValue v, std::exception_ptr e) {
  std::vector<std::function<void()>> waiters;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ready_) return;
    if (e) {
      error_ = std::move(e);
    } else {
      value_ = std::move(v);
    }
    ready_ = true;
    waiters.swap(waiters_);
  }
  cv_.notify_all();
  for (auto& w : waiters) w();
}

void OwnerRRef::drop_waiters() {
  std::vector<std::function<void()>> waiters;
  std::lock_guard<std::mutex> lock(mu_);
  waiters.swap(waiters_);  // destroyed after the lock is released (declared before it)
}

const TypeInfo* OwnerRRef::type() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ready_ && value_.type ? value_.type : type_;
}

bool OwnerRRef::ready() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ready_;
}

void OwnerRRef::when_ready(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ready_) {
      waiters_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

AnyValue OwnerRRef::wait(Millis timeout) const {
  std::unique_lock<std::mutex> lock(mu_);
  if (timeout.count() > 0) {
    if (!cv_.wait_for(lock, timeout, [&] { return ready_; })) {
      throw TimeoutError(str("waited ", timeout.count(), " ms for the value of RRef ", id_.str(),
                             " on its owner (the call creating it has not finished)"));
    }
  } else {
    cv_.wait(lock, [&] { return ready_; });
  }
  if (error_) std::rethrow_exception(error_);
  return value_;
}

AnyValue OwnerRRef::value() const {
  std::lock_guard<std::mutex> lock(mu_);
  TDIST_CHECK(ready_, "RRef ", id_.str(), " has no value yet");
  if (error_) std::rethrow_exception(error_);
  return value_;
}

// ---- UserRRef ----

UserRRef::UserRRef(std::shared_ptr<RRefContext> ctx, RRefId id, ForkId fork, int owner,
                   const TypeInfo* type, RRefSecret secret)
    : RRefBase(ctx, id, owner, type), strong_ctx_(std::move(ctx)), fork_(fork), secret_(secret) {}

UserRRef::~UserRRef() {
  try {
    strong_ctx_->user_deleted(*this);
  } catch (const std::exception& e) {
    TDIST_LOG_WARN("rpc: could not tell the owner that user RRef ", id_.str(), " fork ",
                   fork_.str(), " is gone: ", e.what());
  }
}

std::exception_ptr UserRRef::creation_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return creation_error_;
}

// ---- RRefContext ----

RRefContext::RRefContext(std::weak_ptr<RpcAgent> agent, int rank)
    : agent_(std::move(agent)), rank_(rank) {}

RRefContext::~RRefContext() {
  for (auto& [id, owner] : owners_) owner->drop_waiters();
  for (auto& [id, u] : unborn_) u.owner->drop_waiters();
}

GloballyUniqueId RRefContext::new_id() { return GloballyUniqueId{rank_, next_id_.fetch_add(1)}; }

std::shared_ptr<OwnerRRef> RRefContext::create_owner(const TypeInfo* type, bool registered) {
  auto owner = std::make_shared<OwnerRRef>(weak_from_this(), new_id(), rank_, type);
  if (registered) {
    std::lock_guard<std::mutex> lock(mu_);
    owners_.emplace(owner->id(), owner);
  }
  return owner;
}

RRefContext::Unborn& RRefContext::unborn_locked(const RRefId& id, const TypeInfo* type, int from,
                                                bool& created) {
  size_t& parked = parked_[from];
  if (parked >= kMaxParkedPerPeer) {
    throw InvalidArgument(str("RRef ", id.str(), " is unknown on its owner (rank ", rank_,
                              ") and worker rank ", from, " already has ", parked,
                              " requests waiting for RRefs that do not exist yet (the limit)"));
  }
  Unborn& u = unborn_[id];
  created = !u.owner;
  if (created) u.owner = std::make_shared<OwnerRRef>(weak_from_this(), id, rank_, type);
  u.parked_by.push_back(from);
  ++parked;
  return u;
}

void RRefContext::unpark_locked(const Unborn& u) {
  for (int from : u.parked_by) {
    auto it = parked_.find(from);
    if (it != parked_.end() && --it->second == 0) parked_.erase(it);
  }
}

void RRefContext::schedule_expiry(const RRefId& id) {
  auto agent = agent_.lock();
  if (!agent || agent->options().rpc_timeout.count() <= 0) return;  // waits until shutdown
  std::weak_ptr<RRefContext> weak = weak_from_this();
  agent->schedule(Clock::now() + agent->options().rpc_timeout, [weak, id] {
    if (auto ctx = weak.lock()) ctx->expire_unborn(id);
  });
}

std::exception_ptr RRefContext::unknown_error(const RRefId& id, bool waited) const {
  if (!waited) {
    return std::make_exception_ptr(
        InvalidArgument(str("RRef ", id.str(), " is unknown on its owner (rank ", rank_,
                            "): it was deleted, or never existed")));
  }
  auto agent = agent_.lock();
  const int64_t ms = agent ? agent->options().rpc_timeout.count() : 0;
  return std::make_exception_ptr(
      TimeoutError(str("RRef ", id.str(), " is unknown on its owner (rank ", rank_,
                       "): the call creating it did not arrive within ", ms,
                       " ms (it failed, or the RRef was deleted)")));
}

void RRefContext::expire_unborn(const RRefId& id) {
  Unborn u;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = unborn_.find(id);
    if (it == unborn_.end()) return;  // created meanwhile
    u = std::move(it->second);
    unborn_.erase(it);
    unpark_locked(u);
  }
  u.owner->set_error(unknown_error(id, true));  // answers the fetches and method calls
  for (auto& f : u.on_birth) f(false);
}

std::shared_ptr<OwnerRRef> RRefContext::find_owner(const RRefId& id, const TypeInfo* type,
                                                   int from) {
  bool created = false;
  std::shared_ptr<OwnerRRef> owner;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = owners_.find(id);
    if (it != owners_.end()) return it->second;
    if (id.created_on == rank_) return nullptr;  // made here and gone (invariant 5)
    owner = unborn_locked(id, type, from, created).owner;
  }
  if (created) schedule_expiry(id);
  return owner;
}

std::shared_ptr<OwnerRRef> RRefContext::create_owner_for_call(const RRefId& id,
                                                              const RRefSecret& secret) {
  std::shared_ptr<OwnerRRef> owner;
  std::vector<std::function<void(bool)>> waiting;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = owners_.find(id);
    if (it != owners_.end()) return it->second;  // remote() to ourselves registered it
    auto u = unborn_.find(id);
    if (u != unborn_.end()) {
      owner = std::move(u->second.owner);
      waiting = std::move(u->second.on_birth);
      unpark_locked(u->second);
      unborn_.erase(u);
    } else {
      owner = std::make_shared<OwnerRRef>(weak_from_this(), id, rank_, nullptr);
    }
    owner->set_secret(secret);  // before anyone can find it (invariant 8)
    owners_.emplace(id, owner);
  }
  for (auto& f : waiting) f(true);
  return owner;
}

void RRefContext::check_new_rref(const RRefId& id, const ForkId& fork, int from) const {
  if (id.created_on != from) {
    throw InvalidArgument(str("RRef id ", id.str(), " was made by worker rank ", id.created_on,
                              ", not by rank ", from, " that creates it (refused)"));
  }
  if (fork.created_on >= 0 && fork.created_on != from) {
    throw InvalidArgument(str("fork id ", fork.str(), " was made by worker rank ", fork.created_on,
                              ", not by rank ", from, " (refused)"));
  }
  if (from == rank_) return;  // remote() to ourselves registered the owner before sending
  std::lock_guard<std::mutex> lock(mu_);
  if (owners_.count(id)) {
    throw InvalidArgument(str("RRef ", id.str(), " already exists on its owner (rank ", rank_,
                              "): a creating call cannot reuse it (refused)"));
  }
}

bool RRefContext::holds_fork(const RRefId& id, int rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = forks_.find(id);
  if (it == forks_.end()) return false;
  for (const auto& [fork, holder] : it->second) {
    if (holder == rank) return true;
  }
  return false;
}

std::exception_ptr RRefContext::wrong_secret_error(const RRefId& id, const ForkId& fork,
                                                   int holder) const {
  return std::make_exception_ptr(InvalidArgument(
      str("fork ", fork.str(), " of RRef ", id.str(), " requested by rank ", holder,
          " does not carry the RRef's secret: that worker was never given the RRef (refused)")));
}

bool RRefContext::secret_matches_locked(const RRefId& id, const RRefSecret& secret) const {
  auto it = owners_.find(id);
  return it != owners_.end() && it->second->secret().matches(secret);
}

std::exception_ptr RRefContext::foreign_fork_error(const RRefId& id, const ForkId& fork,
                                                   int holder) const {
  return std::make_exception_ptr(
      InvalidArgument(str("fork ", fork.str(), " of RRef ", id.str(),
                          " is held by another worker, not by rank ", holder, " (refused)")));
}

void RRefContext::add_fork_when_known(const RRefId& id, const ForkId& fork, int holder,
                                      const RRefSecret& secret,
                                      std::function<void(std::exception_ptr)> done) {
  enum class Outcome { kAdded, kForeign, kForged, kUnknown, kWaiting, kWaitingNew } outcome;
  std::exception_ptr refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (owners_.count(id)) {
      if (!secret_matches_locked(id, secret)) {
        outcome = Outcome::kForged;
      } else {
        outcome = add_fork_locked(id, fork, holder) ? Outcome::kAdded : Outcome::kForeign;
      }
    } else if (id.created_on == rank_) {
      outcome = Outcome::kUnknown;  // made here and gone (invariant 5)
    } else {
      std::weak_ptr<RRefContext> weak = weak_from_this();
      bool created = false;
      try {
        unborn_locked(id, nullptr, holder, created)
            .on_birth.push_back([weak, id, fork, holder, secret, done](bool born) {
              auto ctx = weak.lock();
              if (!ctx) return;
              bool genuine = false;
              if (born) {
                std::lock_guard<std::mutex> lock(ctx->mu_);
                genuine = ctx->secret_matches_locked(id, secret);
              }
              if (!born) {
                done(ctx->unknown_error(id, true));
              } else if (!genuine) {
                done(ctx->wrong_secret_error(id, fork, holder));
              } else if (!ctx->add_fork(id, fork, holder)) {
                done(ctx->foreign_fork_error(id, fork, holder));
              } else {
                done(nullptr);
              }
            });
        outcome = created ? Outcome::kWaitingNew : Outcome::kWaiting;
      } catch (const InvalidArgument&) {
        refused = std::current_exception();  // too many requests waiting (invariant 6)
        outcome = Outcome::kUnknown;
      }
    }
  }
  switch (outcome) {
    case Outcome::kAdded:
      done(nullptr);
      break;
    case Outcome::kForeign:
      done(foreign_fork_error(id, fork, holder));
      break;
    case Outcome::kForged:
      done(wrong_secret_error(id, fork, holder));
      break;
    case Outcome::kUnknown:
      done(refused ? refused : unknown_error(id, false));
      break;
    case Outcome::kWaitingNew:
      schedule_expiry(id);  // outside the lock: schedule() takes the agent's lock
      break;
    case Outcome::kWaiting:
      break;
  }
}

std::shared_ptr<UserRRef> RRefContext::create_user_for_remote(int owner, const TypeInfo* type) {
  auto user = std::make_shared<UserRRef>(shared_from_this(), new_id(), new_id(), owner, type,
                                         RRefSecret::random());
  std::lock_guard<std::mutex> lock(mu_);
  pending_users_.emplace(user->fork_id(), user);
  users_.emplace(user->fork_id(),
                 LiveUser{user, str("user RRef ", user->id().str(), " fork ", user->fork_id().str(),
                                    " of ", type ? type->name : "?", " owned by rank ", owner)});
  return user;
}

void RRefContext::finish_pending_user(const ForkId& fork, bool confirmed,
                                      std::exception_ptr error) {
  std::shared_ptr<UserRRef> user;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_users_.find(fork);
    if (it == pending_users_.end()) return;  // idempotent
    user = std::move(it->second);
    pending_users_.erase(it);
  }
  if (error) {
    std::lock_guard<std::mutex> lock(user->mu_);
    user->creation_error_ = error;
  }
  if (confirmed) user->confirmed_ = true;
  // `user` may be the last reference: its destructor sends the deletion, outside our lock.
}

void RRefContext::fork_request_failed(const ForkId& fork, std::exception_ptr error) {
  TDIST_LOG_WARN("rpc: RREF_FORK_REQUEST for fork ", fork.str(),
                 " failed: ", exception_message(error),
                 "; the fork stays pending and its parent keeps its reference (a leak, reported "
                 "at shutdown, rather than a value freed while this worker holds it)");
}

ForkData RRefContext::prepare_child_fork(const std::shared_ptr<RRefBase>& rref, int dest) {
  auto agent = agent_.lock();
  TDIST_CHECK_ARG(!agent || (dest >= 0 && dest < agent->world_size()),
                  "an RRef sent to worker rank ", dest, ", which does not exist");
  ForkData fd;
  fd.rref_id = rref->id();
  fd.fork_id = new_id();
  fd.parent = rank_;
  fd.owner = rref->owner();
  if (const TypeInfo* t = rref->type()) {
    fd.type_hash = t->hash;
    fd.type_name = t->name;
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Invariant 8: the child presents the secret (an owner's is set under mu_).
  fd.secret = rref->is_owner() ? static_cast<const OwnerRRef&>(*rref).secret()
                               : static_cast<const UserRRef&>(*rref).secret();
  if (rref->is_owner()) {
    // Early registration: the owner knows the child before it exists.
    owners_.emplace(rref->id(), std::static_pointer_cast<OwnerRRef>(rref));
    forks_[rref->id()].emplace(fd.fork_id, dest);
  } else {
    // The parent stays alive until the child is confirmed (invariant 2).
    pending_children_.emplace(fd.fork_id, PendingChild{rref, dest});
  }
  return fd;
}

std::shared_ptr<RRefBase> RRefContext::rref_from_fork(const ForkData& fd, int from,
                                                      const TypeInfo* type) {
  auto agent = agent_.lock();
  const int world = agent ? agent->world_size() : 0;
  if (fd.owner < 0 || fd.owner >= world || fd.parent < 0 || fd.parent >= world ||
      fd.parent != from) {
    throw ProtocolError(
        str("bad RRef fork data from rank ", from, ": owner ", fd.owner, ", parent ", fd.parent));
  }
  if (fd.owner == rank_) {
    auto owner = find_owner(fd.rref_id, type, from);
    if (!owner) std::rethrow_exception(unknown_error(fd.rref_id, false));
    {
      // Invariant 8: a registered owner's RRef comes back only from a worker that was given it.
      std::lock_guard<std::mutex> lock(mu_);
      if (owners_.count(fd.rref_id) && !secret_matches_locked(fd.rref_id, fd.secret)) {
        std::rethrow_exception(wrong_secret_error(fd.rref_id, fd.fork_id, from));
      }
    }
    if (fd.parent == rank_) {
      delete_fork(fd.rref_id, fd.fork_id, rank_);  // added when we sent it to ourselves
    } else {
      send_child_accept(fd.parent, fd.fork_id);
    }
    return owner;
  }
  auto user = std::make_shared<UserRRef>(shared_from_this(), fd.rref_id, fd.fork_id, fd.owner, type,
                                         fd.secret);
  {
    std::lock_guard<std::mutex> lock(mu_);
    users_.emplace(fd.fork_id,
                   LiveUser{user, str("user RRef ", fd.rref_id.str(), " fork ", fd.fork_id.str(),
                                      " of ", fd.type_name, " owned by rank ", fd.owner)});
    if (fd.parent != fd.owner) pending_users_.emplace(fd.fork_id, user);
  }
  if (fd.parent == fd.owner) {
    user->confirmed_ = true;  // the owner registered this fork before sending it
  } else {
    send_fork_request(user, fd.parent);
  }
  return user;
}

void RRefContext::send_fork_request(const std::shared_ptr<UserRRef>& user, int parent) {
  const ForkId fork = user->fork_id();
  auto agent = agent_.lock();
  if (!agent) {
    finish_pending_user(fork, false, nullptr);
    return;
  }
  auto m = encode_message(MessageType::kRRefForkRequest, this, user->owner(),
                          std::make_tuple(user->id(), fork, user->secret()));
  std::weak_ptr<RRefContext> weak = weak_from_this();
  agent->send_request(
      user->owner(), std::move(m), agent->options().rpc_timeout,
      [weak, fork, parent](Message*, std::exception_ptr error) {
        auto ctx = weak.lock();
        if (!ctx) return;
        if (error) {
          ctx->fork_request_failed(fork, error);  // no CHILD_ACCEPT: the parent holds on
          return;
        }
        ctx->finish_pending_user(fork, true, nullptr);
        ctx->send_child_accept(parent, fork);
      },
      str("RREF_FORK_REQUEST for RRef ", user->id().str(), " fork ", fork.str()),
      /*on_pool=*/true);
}

void RRefContext::send_child_accept(int parent, const ForkId& fork) {
  if (parent == rank_) {
    child_accepted(fork, rank_);
    return;
  }
  auto agent = agent_.lock();
  if (!agent) return;
  auto m = encode_message(MessageType::kRRefChildAccept, this, parent, std::make_tuple(fork));
  agent->send_request(
      parent, std::move(m), agent->options().rpc_timeout,
      [fork](Message*, std::exception_ptr error) {
        if (!error) return;
        TDIST_LOG_WARN("rpc: RREF_CHILD_ACCEPT for fork ", fork.str(),
                       " failed: ", exception_message(error));
      },
      str("RREF_CHILD_ACCEPT for fork ", fork.str()), /*on_pool=*/true);
}

bool RRefContext::add_fork_locked(const RRefId& id, const ForkId& fork, int holder) {
  auto [it, added] = forks_[id].emplace(fork, holder);
  return added || it->second == holder;
}

bool RRefContext::add_fork(const RRefId& id, const ForkId& fork, int holder) {
  std::lock_guard<std::mutex> lock(mu_);
  return add_fork_locked(id, fork, holder);
}

bool RRefContext::delete_fork(const RRefId& id, const ForkId& fork, int holder) {
  std::shared_ptr<OwnerRRef> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = forks_.find(id);
    if (it == forks_.end()) return true;  // idempotent
    auto f = it->second.find(fork);
    if (f == it->second.end()) return true;
    if (f->second != holder) return false;  // invariant 6
    it->second.erase(f);
    if (!it->second.empty()) return true;
    forks_.erase(it);
    auto o = owners_.find(id);
    if (o != owners_.end() && o->second->ready()) {
      dropped = std::move(o->second);
      owners_.erase(o);
    }
  }
  // `dropped` may hold the last reference to the value: freed here, outside the lock.
  return true;
}

void RRefContext::owner_ready(const RRefId& id) {
  std::shared_ptr<OwnerRRef> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto f = forks_.find(id);
    if (f != forks_.end() && !f->second.empty()) return;
    auto o = owners_.find(id);
    if (o != owners_.end() && o->second->ready()) {
      dropped = std::move(o->second);
      owners_.erase(o);
    }
  }
}

bool RRefContext::child_accepted(const ForkId& fork, int from) {
  std::shared_ptr<RRefBase> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_children_.find(fork);
    if (it == pending_children_.end()) return true;  // idempotent
    if (it->second.dest != from) return false;       // invariant 6
    dropped = std::move(it->second.parent);
    pending_children_.erase(it);
  }
  return true;
}

void RRefContext::user_deleted(UserRRef& user) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    users_.erase(user.fork_id());
  }
  if (user.deleted_.exchange(true)) return;  // delete_all_users told the owner already
  send_user_delete(user.owner(), user.id(), user.fork_id());
}

void RRefContext::send_user_delete(int owner, const RRefId& id, const ForkId& fork) {
  auto agent = agent_.lock();
  if (!agent || agent->is_shut_down()) return;  // after shutdown: reported as leaked
  // Posted: the last handle may go on any thread, e.g. a connection's reader completing a
  // response inline, which must never write (a full socket would stall every response).
  std::weak_ptr<RRefContext> weak = weak_from_this();
  agent->post_work([weak, owner, id, fork] {
    auto ctx = weak.lock();
    auto agent = ctx ? ctx->agent() : nullptr;
    if (!agent) return;
    auto m =
        encode_message(MessageType::kRRefUserDelete, ctx.get(), owner, std::make_tuple(id, fork));
    agent->send_request(
        owner, std::move(m), agent->options().rpc_timeout,
        [id](Message*, std::exception_ptr error) {
          if (!error) return;
          TDIST_LOG_WARN("rpc: RREF_USER_DELETE for RRef ", id.str(),
                         " failed: ", exception_message(error));
        },
        str("RREF_USER_DELETE for RRef ", id.str(), " fork ", fork.str()), /*on_pool=*/true);
  });
}

size_t RRefContext::delete_all_users() {
  std::vector<std::shared_ptr<UserRRef>> users;
  std::vector<std::shared_ptr<OwnerRRef>> unforked;  // dropped outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::set<const RRefBase*> parents;
    for (const auto& [fork, child] : pending_children_) parents.insert(child.parent.get());
    for (auto it = users_.begin(); it != users_.end();) {
      auto user = it->second.user.lock();
      // Pending users and parents of pending children stay (invariants 1 and 2).
      if (!user || pending_users_.count(it->first) || parents.count(user.get())) {
        ++it;
        continue;
      }
      users.push_back(std::move(user));
      it = users_.erase(it);
    }
    for (auto it = owners_.begin(); it != owners_.end();) {
      // A remote() to ourselves still running keeps its entry until its value is set.
      auto f = forks_.find(it->first);
      if ((f == forks_.end() || f->second.empty()) && it->second->ready()) {
        unforked.push_back(std::move(it->second));
        it = owners_.erase(it);
      } else {
        ++it;
      }
    }
  }
  size_t sent = 0;
  for (auto& u : users) {
    if (u->deleted_.exchange(true)) continue;
    send_user_delete(u->owner(), u->id(), u->fork_id());
    ++sent;
  }
  return sent;
}

std::vector<std::string> RRefContext::registered() const {
  std::vector<std::string> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, owner] : owners_) {
    auto f = forks_.find(id);
    size_t n = f == forks_.end() ? 0 : f->second.size();
    const TypeInfo* t = owner->type();
    out.push_back(str("owned RRef ", id.str(), t ? " of " + t->name : std::string(), " with ", n,
                      " user fork(s)", owner->ready() ? "" : " and no value yet"));
  }
  for (const auto& [fork, user] : users_) out.push_back(user.what);
  for (const auto& [fork, user] : pending_users_) {
    out.push_back(str("pending user fork ", fork.str(), " (owner has not confirmed it)"));
  }
  for (const auto& [fork, child] : pending_children_) {
    out.push_back(str("pending child fork ", fork.str(), " of RRef ", child.parent->id().str(),
                      " sent to rank ", child.dest, " (not accepted)"));
  }
  for (const auto& [id, u] : unborn_) {
    out.push_back(str("RRef ", id.str(), ": ", u.on_birth.size(),
                      " fork request(s) and the fetches or calls waiting for its creation"));
  }
  return out;
}

size_t RRefContext::num_owned() const {
  std::lock_guard<std::mutex> lock(mu_);
  return owners_.size();
}

size_t RRefContext::num_forks(const RRefId& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto f = forks_.find(id);
  return f == forks_.end() ? 0 : f->second.size();
}

size_t RRefContext::num_pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_users_.size() + pending_children_.size();
}

size_t RRefContext::num_unborn() const {
  std::lock_guard<std::mutex> lock(mu_);
  return unborn_.size();
}

size_t RRefContext::num_parked() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [rank, count] : parked_) n += count;
  return n;
}

}  // namespace tdist::rpc::detail
