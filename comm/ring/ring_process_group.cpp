#include "tdist/comm/ring/ring_process_group.h"
#include "tdist/comm/ring/ring_tuning.h"

#include <unistd.h>

#include <algorithm>
#include <set>

#include "tdist/comm/ring/staged_message.h"
#include "tdist/comm/ring/staging.h"
#include "tdist/comm/transport/shm/shm_channel.h"
#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/prefix_store.h"
#include "tdist/core/tensor_wire.h"
#include "tdist/core/token.h"

namespace tdist::comm::detail {
namespace {

// Work of recv_any_source: remembers where the message came from.
class RecvWork : public Work {
 public:
  using Work::Work;
  int source_rank() const override { return source_.load(); }
  std::atomic<int> source_{-1};
};

Clock::time_point deadline_after(Millis timeout, Clock::time_point now = Clock::now()) {
  if (timeout > std::chrono::duration_cast<Millis>(Clock::time_point::max() - now)) {
    return Clock::time_point::max();
  }
  return now + timeout;
}

// Note [Small operations]
// A warm 4 KiB allreduce costs about as much as two core-to-core round trips, so what the call
// itself does counts: each heap allocation is tens of nanoseconds and, on a busy allocator, a
// lock. The small-operation path allocates nothing but the result list (a Work's result is a
// std::vector<at::Tensor>, which the API hands out), counted in
// tests/comm/alloc_count_test.cpp (at most one allocation per operation on all threads
// together):
//   - The op lives in a list node that moves between queue_, the running thread and free_ops_ by
//     splicing (OpList), so queueing one allocates nothing once the group is warm.
//   - An allreduce, a broadcast, an allgather (list or flat) and a reduce-scatter (list or flat)
//     of host tensors keep their tensors, reduction and root in the Op (SmallArgs, by Kind)
//     instead of a capturing std::function, which would not fit std::function's inline buffer;
//     a list is moved in, and an allgather's comes back as its result (no allocation at all).
//     Their block lists are the group's own vectors (reserved at construction), a buffer that
//     fits one window needs no slice list (Note [Windows]), and StagedTensors::may_stage
//     answers before any list is built for the staging checks. The other operations, and a
//     list holding strided tensors, still build a Run.
//   - The Future and the Work are made with allocate_shared from PooledBlocks: blocks freed go
//     to a cache of the freeing thread and are taken from the allocating thread's cache, so a
//     caller that issues, waits and drops its Works on one thread reuses the same blocks with no
//     lock; when another thread frees them (the worker ran the op and dropped the last
//     reference), a full cache hands its blocks to a shared depot (one mutex) that an empty
//     cache takes from, and only beyond both caps are blocks given back to the heap.
// What is left on the caller's path is the group's mutex (the queue), taken once to queue and
// once to take and finish the op.
struct FreeBlock {
  FreeBlock* next;
};

template <size_t kBytes>
class PooledBlocks {
 public:
  static void* get() {
    Local& l = local();
    if (l.head != nullptr) return l.pop();
    if (!dead_) {
      Depot& d = depot();
      std::lock_guard<std::mutex> lock(d.mu);
      if (d.list.head != nullptr) return d.list.pop();
    }
    return ::operator new(kBytes);
  }
  static void put(void* p) {
    if (!dead_) {
      Local& l = local();
      if (l.count < kLocalCap) return l.push(p);
      Depot& d = depot();
      std::lock_guard<std::mutex> lock(d.mu);
      if (d.list.count < kDepotCap) return d.list.push(p);
    }
    ::operator delete(p);
  }

 private:
  static constexpr size_t kLocalCap = 64;
  static constexpr size_t kDepotCap = 1024;
  struct List {
    FreeBlock* head = nullptr;
    size_t count = 0;
    void* pop() {
      FreeBlock* b = head;
      head = b->next;
      --count;
      return b;
    }
    void push(void* p) {
      auto* b = static_cast<FreeBlock*>(p);
      b->next = head;
      head = b;
      ++count;
    }
  };
  struct Local : List {
    ~Local() {
      dead_ = true;  // a block freed later on this thread goes back to the heap
      while (this->head != nullptr) ::operator delete(this->pop());
    }
  };
  struct Depot {
    std::mutex mu;
    List list;
  };
  static Local& local() {
    static thread_local Local l;
    return l;
  }
  static Depot& depot() {
    static Depot* d = new Depot;  // never destroyed: blocks may be freed during exit
    return *d;
  }
  static thread_local bool dead_;
};
template <size_t kBytes>
thread_local bool PooledBlocks<kBytes>::dead_ = false;

// The allocator allocate_shared uses for a Work or a Future (with its control block).
template <typename T>
struct PoolAllocator {
  using value_type = T;
  static constexpr size_t kBytes = (sizeof(T) + 63) / 64 * 64;
  PoolAllocator() = default;
  template <typename U>
  PoolAllocator(const PoolAllocator<U>&) {}
  T* allocate(size_t n) {
    static_assert(alignof(T) <= alignof(std::max_align_t));
    if (n != 1) return static_cast<T*>(::operator new(n * sizeof(T)));
    return static_cast<T*>(PooledBlocks<kBytes>::get());
  }
  void deallocate(T* p, size_t n) {
    if (n != 1) return ::operator delete(p);
    PooledBlocks<kBytes>::put(p);
  }
  template <typename U>
  bool operator==(const PoolAllocator<U>&) const {
    return true;
  }
  template <typename U>
  bool operator!=(const PoolAllocator<U>&) const {
    return false;
  }
};

// Note [Spin, then sleep]
// A peer on this host usually answers within microseconds, and a futex sleep plus wake-up costs
// several of them; so a rank with shared-memory peers spins (re-trying its transfers, yielding
// the core between tries) for kSpinUs before it sleeps. Each try yields, so on a host with more
// ranks than cores the spinner hands its core to a peer that has work; and a spin that runs out
// makes the next waits skip theirs, more of them each time (Exchange::run_impl), so ranks that
// wait for slow peers (large transfers, DDP waiting on computation) soon stop spinning. Measured
// in docs/perf-history.md ("Waking a rank", "RPC waits spin first"): at world 4 on 2 cores,
// spinning halves a 4 KiB allreduce and changes neither larger ones nor DDP's throughput.
// TDIST_SPIN_US overrides (0: never spin).
// A yield is a system call, and it is most of what a rank waiting on an idle peer pays per try:
// when every rank of this host can have a core of its own (no more ranks on the host than CPUs
// this process may run on), the first kBusyPollNs of each spin re-try with only a CPU pause
// between tries (no core is wanted by anyone else then), which halved a 4 KiB allreduce and a
// barrier at world 2 on 2 cores. With more ranks than cores it would keep a peer that has work
// off the core, which made world 4 on 2 cores slower, so there every try yields as before. The
// scheduler may still put two ranks on one core (seen about once in 15 runs at world 2 on 2
// cores); a busy poll that runs out therefore makes the next 1, 3, 7 ... 63 spins yield from
// their start, like the spin's own back-off, and such a run costs what yielding alone costs.
// TDIST_BUSY_POLL_NS overrides (0: always yield).
constexpr int kSpinUs = 50;
constexpr int kBusyPollNs = 2000;

int default_spin_us(const std::vector<std::unique_ptr<Channel>>& channels) {
  for (const auto& c : channels) {
    if (c && std::string(c->kind()) == "shm") return kSpinUs;
  }
  return 0;
}

// kBusyPollNs when this host's ranks (those with this rank's host key) fit on the CPUs this
// process may run on, else 0 (Note [Spin, then sleep]).
int default_busy_poll_ns(const std::vector<std::string>& hosts, int rank) {
  const auto local = std::count(hosts.begin(), hosts.end(), hosts[rank]);
  return static_cast<size_t>(local) <= env::allowed_cpus().size() ? kBusyPollNs : 0;
}

// The hosts of the group from every rank's host key, when each has the same number of ranks (at
// least two) and there are at least two of them. Hosts are ordered by their lowest rank, so
// every rank derives the same hierarchy.
std::optional<algorithms::Hierarchy> find_hierarchy(const std::vector<std::string>& hosts,
                                                    int rank) {
  std::vector<std::vector<int>> groups;
  std::vector<const std::string*> keys;
  for (int r = 0; r < static_cast<int>(hosts.size()); ++r) {
    size_t g = 0;
    while (g < keys.size() && *keys[g] != hosts[r]) ++g;
    if (g == keys.size()) {
      keys.push_back(&hosts[r]);
      groups.emplace_back();
    }
    groups[g].push_back(r);
  }
  const size_t per_host = groups[0].size();
  if (groups.size() < 2 || per_host < 2) return std::nullopt;
  for (const auto& g : groups) {
    if (g.size() != per_host) return std::nullopt;
  }
  algorithms::Hierarchy h;
  for (int g = 0; g < static_cast<int>(groups.size()); ++g) {
    auto it = std::find(groups[g].begin(), groups[g].end(), rank);
    if (it == groups[g].end()) continue;
    h.local = groups[g];
    h.host_index = g;
    h.local_index = static_cast<int>(it - groups[g].begin());
  }
  for (const auto& g : groups) h.cross.push_back(g[static_cast<size_t>(h.local_index)]);
  return h;
}

// Values the group must agree on before any operation: every rank sends its own to every peer,
// and all take the largest of each. The single-copy threshold (Note [Single-copy collectives]
// in algorithms/single_copy.h; kNoSingleCopy from a rank that may not or cannot read every peer) and the
// window of the ring collectives (Note [Windows]).
struct Agreed {
  uint64_t single_copy_bytes;
  uint64_t window_bytes;
};
Agreed agree_group_values(Exchange& ex, Agreed mine, Clock::time_point deadline) {
  ex.begin("process group set-up", 0, Clock::now(), deadline);
  std::vector<Agreed> theirs(static_cast<size_t>(ex.size()), mine);
  ex.swap_with_all(&mine, theirs.data(), sizeof(mine));
  for (const Agreed& a : theirs) {
    mine.single_copy_bytes = std::max(mine.single_copy_bytes, a.single_copy_bytes);
    mine.window_bytes = std::max(mine.window_bytes, a.window_bytes);
  }
  return mine;
}
}  // namespace

RingProcessGroup::RingProcessGroup(std::shared_ptr<Store> root_store, std::string prefix, int rank,
                                   int size, Options opts)
    : root_store_(std::move(root_store)),
      prefix_(std::move(prefix)),
      rank_(rank),
      size_(size),
      opts_(std::move(opts)) {
  TDIST_CHECK_ARG(size >= 1, "world size must be >= 1, got ", size);
  TDIST_CHECK_ARG(rank >= 0 && rank < size, "rank must be in [0, ", size, "), got ", rank);
  TDIST_CHECK_ARG(opts_.timeout.count() > 0, "timeout must be positive, got ",
                  opts_.timeout.count(), " ms");
  const RingTuningValues tuning = resolve_ring_tuning(opts_.ring);
  chunk_bytes_ = tuning.chunk_bytes;
  small_allreduce_bytes_ = tuning.small_allreduce_bytes;
  staging_piece_bytes_ = tuning.staging_piece_bytes;
  window_bytes_ = tuning.window_bytes;
  allreduce_algo_ = tuning.allreduce_algo;
  debug_detail_ = tuning.debug_detail;
  run_on_waiter_ = tuning.run_on_waiter;

  auto store = std::make_shared<PrefixStore>(prefix_, root_store_);
  const auto setup_deadline = deadline_after(opts_.timeout);
  mesh_ = std::make_unique<tcp::Mesh>(
      *store, rank_, size_, 2, tcp::fnv1a(prefix_),
      resolve_token(opts_.token, "ProcessGroup::Options::token").value, setup_deadline);
  ChannelOptions copts;
  copts.allow_shm = tuning.shared_memory;
  copts.shm_capacity = tuning.shm_bytes;
  if (opts_.host) copts.host = *opts_.host;
  copts.group = tcp::fnv1a(prefix_);
  auto channels = make_channels(*mesh_, 0, copts, setup_deadline);
  channels_ = std::move(channels.peers);
  hierarchy_ = find_hierarchy(channels.hosts, rank_);
  if (hierarchy_) {
    TDIST_LOG_DEBUG("rank ", rank_, ": ", hierarchy_->cross.size(), " hosts of ",
                    hierarchy_->local.size(), " ranks: hierarchical allreduce above ",
                    small_allreduce_bytes_, " bytes");
  }
  std::vector<Channel*> peers;
  for (auto& c : channels_) peers.push_back(c.get());
  exchange_ = std::make_unique<Exchange>(peers, rank_, &aborted_);
  exchange_->set_spin_us(tuning.spin_us.value_or(default_spin_us(channels_)));
  exchange_->set_busy_poll_ns(
      tuning.busy_poll_ns.value_or(default_busy_poll_ns(channels.hosts, rank_)));
  exchange_->set_wait_alone(tuning.shm_futex);
  if (size_ > 1) {
    bool readable = tuning.single_copy;
    for (int p = 0; p < size_; ++p) {
      readable = readable && (p == rank_ || channels.readable_pids[p] != 0);
    }
    const uint64_t threshold = tuning.single_copy_bytes;
    const Agreed agreed = agree_group_values(
        *exchange_, Agreed{readable ? threshold : kNoSingleCopy, window_bytes_}, setup_deadline);
    single_copy_bytes_ = agreed.single_copy_bytes;
    window_bytes_ = static_cast<size_t>(agreed.window_bytes);
    if (single_copy_bytes_ != kNoSingleCopy) {
      peer_pids_ = channels.readable_pids;
      peer_pids_[rank_] = ::getpid();
    }
  }
  p2p_ = std::make_unique<P2PEngine>(mesh_->channel(1), rank_,
                                     [this](std::exception_ptr e) { abort_with(e); });
  blocks_.reserve(static_cast<size_t>(size_));
  in_blocks_.reserve(static_cast<size_t>(size_));
  worker_ = std::thread([this] { worker_loop(); });
  TDIST_LOG_DEBUG("rank ", rank_, ": process group '", prefix_, "' of ", size_, " ranks is up");
}

RingProcessGroup::~RingProcessGroup() {
  bool busy;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    busy = running_ || !queue_.empty();
  }
  if (busy) {
    abort_with(std::make_exception_ptr(
        Error(str("rank ", rank_, ": the process group was destroyed with operations pending"))));
  }
  cv_.notify_all();
  worker_.join();
  p2p_->stop();
}

std::exception_ptr RingProcessGroup::aborted_error(const char* name, uint64_t seq) const {
  std::string cause;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (abort_cause_) cause = exception_message(abort_cause_);
  }
  return std::make_exception_ptr(Error(str("rank ", rank_, ": ", name, " (seq ", seq,
                                           ") failed: the process group was aborted",
                                           cause.empty() ? "" : " after: ", cause)));
}

void RingProcessGroup::abort() {
  abort_with(std::make_exception_ptr(Error(str("rank ", rank_, ": abort() was called"))));
}

void RingProcessGroup::abort_with(std::exception_ptr cause) {
  OpList pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.load()) return;
    abort_cause_ = cause;
    aborted_.store(true);
    pending.swap(queue_);
  }
  TDIST_LOG_WARN("rank ", rank_, ": aborting the process group: ", exception_message(cause));
  // Wakes the worker (blocked in poll on these sockets, or on a shared-memory channel's futex)
  // and tells every peer at once.
  mesh_->shutdown_all();
  for (auto& c : channels_) {
    if (c) c->shutdown();
  }
  p2p_->abort(cause);
  for (auto& op : pending) op->future->set_error(aborted_error(op->name, op->seq));
  cv_.notify_all();
}

std::shared_ptr<Work> RingProcessGroup::enqueue(const char* name, Millis timeout, Fingerprint fp,
                                                Run run) {
  return enqueue_impl(name, Kind::kRun, timeout, std::move(fp), &run, nullptr);
}

std::shared_ptr<Work> RingProcessGroup::enqueue_small(const char* name, Kind kind, Millis timeout,
                                                      Fingerprint fp, SmallArgs args) {
  return enqueue_impl(name, kind, timeout, std::move(fp), nullptr, &args);
}

std::shared_ptr<Work> RingProcessGroup::enqueue_impl(const char* name, Kind kind, Millis timeout,
                                                     Fingerprint fp, Run* run, SmallArgs* args) {
  // Note [Small operations]: pooled Future and Work, a recycled Op.
  auto future = std::allocate_shared<Future>(PoolAllocator<Future>());
  const auto enqueued = Clock::now();
  uint64_t seq;
  bool aborted, tell = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TDIST_CHECK(!stop_, "the process group is being destroyed");
    seq = next_seq_++;
    aborted = aborted_.load();
    if (!aborted) {
      if (free_ops_.empty()) free_ops_.push_back(std::make_unique<Op>());
      queue_.splice(queue_.end(), free_ops_, free_ops_.begin());
      Op& op = *queue_.back();
      op.enqueued = enqueued;
      op.name = name;
      op.seq = seq;
      op.timeout = effective(timeout);
      op.future = future;
      op.kind = kind;
      if (args != nullptr) {
        op.args = std::move(*args);
      } else {
        op.run = std::move(*run);
      }
      if (debug_detail_) {
        fp.op = name;
        fp.seq = seq;
        op.fingerprint = std::move(fp);
      }
      tell = op.worker_told = !lazy_;
    }
  }
  // Every op name is a string literal (Work::StaticName: no copy of it).
  auto work =
      std::allocate_shared<Work>(PoolAllocator<Work>(), Work::StaticName{name}, seq, future);
  if (aborted) {
    future->set_error(aborted_error(name, seq));
    return work;
  }
  if (run_on_waiter_) {
    // Two words, so std::function keeps them inline (no allocation per operation).
    work->set_progress([this, seq](bool may_run_here) { progress(seq, may_run_here); });
  }
  if (tell) cv_.notify_one();
  return work;
}

// Note [Waiter runs the operation]
// A caller that waits on a collective as soon as it issued it (the blocking style of MPI and of
// torch.distributed without async_op) would otherwise hand the operation to the worker thread
// and sleep until the worker hands the result back: two thread wake-ups per operation, which on
// a host with more runnable threads than cores cost more than a small collective itself. So
// Work::wait() (without a timeout of its own) calls progress(seq, ..., true): when the operation
// is the next one due (first in the queue, nothing running), the waiting thread takes it and
// runs it itself. Order is kept because only the first queued operation can be taken, and only
// one thread runs operations at a time (running_); the worker waits while running_ is set.
// The exchange and scratch are used by whichever thread holds running_. Continuations then run
// on the waiting thread.
//
// Waking the worker for each operation costs as much again (a futex wake on the caller, the
// worker scheduled onto a core the peer ranks need, only to find the operation taken): measured
// in docs/perf-history.md ("Waking a rank"), a third of a 4 KiB allreduce. So the group
// learns the caller's style:
//   - An operation whose wait() comes within kPromptWait of its issue, while it is still queued,
//     is "waited promptly".
//     After kPromptStreak such operations in a row the group turns lazy_: new operations are
//     queued without waking the worker (worker_told = false), for their waiter to run.
//   - Anything else is asynchronous use and turns lazy_ off at once, telling the worker of every
//     operation it was not told of: a wait() that comes later than kPromptWait, and every other
//     look at a pending operation (wait with a timeout, is_completed, future(): DDP's buckets
//     and comm hooks, dropping the Work). A prompt wait() that cannot take its operation (another
//     is ahead or running) tells the worker too.
//   - While lazy_, the worker sleeps kLazyPickup at a time and runs an operation nobody has
//     claimed for that long, turning lazy_ off (a caller that issued and then computed). After
//     kLazyIdleRounds empty rounds it turns lazy_ off and sleeps until told, so an idle group
//     does not keep waking.
// So an operation nobody waits on still runs on the worker (asynchronous use progresses; at
// worst kLazyPickup late, once, when a blocking caller turns asynchronous), and a blocking
// caller pays neither wake-up. TDIST_RUN_ON_WAITER=0 turns all of it off (the worker runs
// every operation; tdist-bench compares the two).
namespace {
constexpr auto kPromptWait = std::chrono::microseconds(100);
constexpr int kPromptStreak = 2;
constexpr auto kLazyPickup = std::chrono::milliseconds(5);
constexpr int kLazyIdleRounds = 100;
}  // namespace

bool RingProcessGroup::tell_worker_locked() {
  bool told = false;
  for (auto& op : queue_) {
    if (!op->worker_told) op->worker_told = told = true;
  }
  return told;
}

void RingProcessGroup::progress(uint64_t seq, bool may_run_here) {
  OpList op;
  bool tell = false;
  Clock::time_point now;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // An operation no longer queued was taken by the worker: not a prompt wait.
    bool prompt = false;
    if (may_run_here) {
      for (const auto& queued : queue_) {
        if (queued->seq != seq) continue;
        now = Clock::now();
        prompt = now - queued->enqueued <= kPromptWait;
        break;
      }
    }
    if (prompt) {
      if (++prompt_waits_ >= kPromptStreak) lazy_ = true;
    } else {
      lazy_ = false;
      prompt_waits_ = 0;
    }
    if (may_run_here && !running_ && !stop_ && !queue_.empty() && queue_.front()->seq == seq) {
      op.splice(op.end(), queue_, queue_.begin());
      running_ = true;
    }
    // Outside lazy_ the worker knows every queued op; and if this one could not be taken here,
    // the worker must run it (after those ahead of it).
    if (!lazy_ || op.empty()) tell = tell_worker_locked();
  }
  if (tell) cv_.notify_one();
  if (!op.empty()) execute(op, now);
}

void RingProcessGroup::worker_loop() {
  int idle_rounds = 0;
  for (;;) {
    OpList op;
    {
      std::unique_lock<std::mutex> lock(mu_);
      for (;;) {
        if (stop_ && queue_.empty()) return;
        // Not while a waiter runs an operation (Note [Waiter runs the operation]).
        if (!queue_.empty() && !running_ &&
            (queue_.front()->worker_told ||
             Clock::now() - queue_.front()->enqueued >= kLazyPickup)) {
          break;
        }
        if (!lazy_) {
          cv_.wait(lock);
          continue;
        }
        if (cv_.wait_for(lock, kLazyPickup) == std::cv_status::timeout && queue_.empty() &&
            ++idle_rounds >= kLazyIdleRounds) {
          lazy_ = false;
          prompt_waits_ = 0;
        }
      }
      idle_rounds = 0;
      op.splice(op.end(), queue_, queue_.begin());
      if (!op.front()
               ->worker_told) {  // nobody claimed it within kLazyPickup: the caller is asynchronous
        lazy_ = false;
        prompt_waits_ = 0;
        tell_worker_locked();
      }
      running_ = true;
    }
    execute(op, Clock::now());
  }
}

void RingProcessGroup::finish_running(OpList& node) {
  static constexpr size_t kFreeOpsCap = 16;
  Op& op = *node.front();
  op.future.reset();
  op.fingerprint = Fingerprint{};
  op.run = nullptr;
  op.kind = Kind::kRun;
  op.args = SmallArgs{};  // the caller's tensors are not kept
  op.worker_told = false;
  bool more;
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
    more = !queue_.empty() && queue_.front()->worker_told;
    if (free_ops_.size() < kFreeOpsCap) free_ops_.splice(free_ops_.end(), node);
  }
  // The worker waits for running_ to clear when a waiter ran the operation.
  if (more) cv_.notify_one();
}

void RingProcessGroup::execute(OpList& node, Clock::time_point now) {
  Op& op = *node.front();
  const char* name = op.name;
  const uint64_t seq = op.seq;
  std::shared_ptr<Future> future = op.future;
  if (aborted_.load()) {
    finish_running(node);
    future->set_error(aborted_error(name, seq));
    return;
  }
  Future::Value value;
  std::exception_ptr error;
  try {
    exchange_->begin(name, seq, now, deadline_after(op.timeout, now));
    if (debug_detail_) check_fingerprints(*exchange_, op.fingerprint);
    algorithms::Context ctx{*exchange_, rank_,       size_,        chunk_bytes_,
                            scratch_,   &peer_pids_, window_bytes_};
    value = op.kind == Kind::kRun ? op.run(ctx) : run_small(ctx, op.kind, op.args);
  } catch (const MismatchError&) {
    error = std::current_exception();
  } catch (...) {
    error = std::current_exception();
    // The byte streams are no longer in step (or a peer is gone): nothing later can succeed.
    abort_with(error);
  }
  // Before completing: a caller that waited for this op may destroy the group at once, and
  // must not find it busy. The op's own references (its Run's captures, its tensors) go with it.
  finish_running(node);
  try {
    if (error) {
      future->set_error(error);
    } else {
      future->set_value(std::move(value));
    }
  } catch (const std::exception& e) {
    TDIST_LOG_ERROR("rank ", rank_, ": a continuation of ", name, " (seq ", seq,
                    ") threw: ", e.what());
  }
}

std::shared_ptr<Work> RingProcessGroup::post_p2p(bool is_send, at::Tensor tensor, int peer, int tag,
                                                 Millis timeout) {
  const char* name = is_send ? "send" : (peer < 0 ? "recv_any_source" : "recv");
  check_stageable(tensor, name, "the tensor");
  if (peer >= 0 || is_send) {
    TDIST_CHECK_ARG(peer >= 0 && peer < size_, name, ": peer rank ", peer, " is not in [0, ", size_,
                    ")");
    TDIST_CHECK_ARG(peer != rank_, name, ": rank ", rank_,
                    " cannot send to or receive from itself");
  }
  TDIST_CHECK_ARG(tag >= 0, name, ": tag must be >= 0, got ", tag);
  const uint64_t seq = next_p2p_seq_++;
  auto future = std::make_shared<Future>();
  auto work = std::make_shared<RecvWork>(name, seq, future);
  if (aborted_.load()) {
    future->set_error(aborted_error(name, seq));
    return work;
  }
  auto deadline = deadline_after(effective(timeout));
  // Large CUDA tensors stream through host memory window by window (Note [Staged messages]);
  // the rest go through a host copy of the whole tensor (`buffer`), which a receive copies back
  // into `tensor` after it completes.
  std::shared_ptr<StagedMessage> staged;
  StandIns stand_ins;
  at::Tensor buffer;
  if (StagedMessage::wanted(tensor, size_, staging_piece_bytes_)) {
    staged = std::make_shared<StagedMessage>(
        is_send ? stand_ins.read(tensor) : stand_ins.written(tensor), is_send, window_bytes_,
        staging_piece_bytes_);
  } else {
    buffer = is_send ? host_values(tensor) : host_output(tensor);
  }
  std::weak_ptr<RecvWork> weak = work;
  auto done = [tensor, buffer, staged, stand_ins, future, weak, is_send](int source,
                                                                         std::exception_ptr error) {
    if (!error && !is_send) {
      try {
        if (staged) {
          staged->complete();
          stand_ins.copy_back();
        } else if (!buffer.is_same(tensor)) {
          tensor.copy_(buffer);
        }
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (!is_send) {
      if (auto w = weak.lock()) w->source_.store(source);
    }
    if (error) {
      future->set_error(error);
    } else {
      future->set_value({tensor});
    }
  };
  if (staged) {
    if (is_send) {
      p2p_->send(staged, tensor.nbytes(), peer, static_cast<uint32_t>(tag), deadline, seq,
                 std::move(done));
    } else {
      p2p_->recv(staged, tensor.nbytes(), peer, static_cast<uint32_t>(tag), deadline, seq,
                 std::move(done));
    }
    return work;
  }
  const size_t bytes = buffer.numel() * buffer.element_size();
  if (is_send) {
    p2p_->send(buffer.data_ptr(), bytes, peer, static_cast<uint32_t>(tag), deadline, seq,
               std::move(done));
  } else {
    p2p_->recv(buffer.data_ptr(), bytes, peer, static_cast<uint32_t>(tag), deadline, seq,
               std::move(done));
  }
  return work;
}

std::shared_ptr<Work> RingProcessGroup::send(at::Tensor tensor, int dst, int tag,
                                             const SendRecvOptions& opts) {
  return post_p2p(true, std::move(tensor), dst, tag, opts.timeout);
}

std::shared_ptr<Work> RingProcessGroup::recv(at::Tensor tensor, int src, int tag,
                                             const SendRecvOptions& opts) {
  TDIST_CHECK_ARG(src >= 0 && src < size_, "recv: source rank ", src, " is not in [0, ", size_,
                  ")");
  return post_p2p(false, std::move(tensor), src, tag, opts.timeout);
}

std::shared_ptr<Work> RingProcessGroup::recv_any_source(at::Tensor tensor, int tag,
                                                        const SendRecvOptions& opts) {
  return post_p2p(false, std::move(tensor), -1, tag, opts.timeout);
}

std::shared_ptr<ProcessGroup> RingProcessGroup::new_group(std::vector<int> ranks,
                                                          const Options& opts) {
  TDIST_CHECK_ARG(!ranks.empty(), "new_group: the rank list is empty");
  std::set<int> unique(ranks.begin(), ranks.end());
  TDIST_CHECK_ARG(unique.size() == ranks.size(), "new_group: the rank list has duplicates");
  for (int r : ranks) {
    TDIST_CHECK_ARG(r >= 0 && r < size_, "new_group: rank ", r, " is not in [0, ", size_, ")");
  }
  // Every rank of this group counts every new_group call, member or not, so the prefix agrees.
  const int index = next_subgroup_++;
  std::sort(ranks.begin(), ranks.end());
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  if (it == ranks.end()) return nullptr;
  return std::make_shared<RingProcessGroup>(root_store_, str(prefix_, "/sub", index),
                                            static_cast<int>(it - ranks.begin()),
                                            static_cast<int>(ranks.size()), opts);
}

}  // namespace tdist::comm::detail
