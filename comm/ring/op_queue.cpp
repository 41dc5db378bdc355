#include "tdist/comm/ring/op_queue.h"

#include "tdist/core/error.h"
#include "tdist/core/logging.h"

namespace tdist::comm::detail {
namespace {

// Note [Small operations]
// A warm 4 KiB allreduce costs about as much as two core-to-core round trips, so what the call
// itself does counts: each heap allocation is tens of nanoseconds and, on a busy allocator, a
// lock. The small-operation path allocates nothing, counted in tests/comm/alloc_count_test.cpp
// (fewer than one allocation per operation on all threads together):
//   - The op lives in a list node that moves between the queue, the running thread and the free
//     list by splicing (OpQueue::NodeList), so queueing one allocates nothing once the group is
//     warm.
//   - An allreduce, a broadcast, an allgather (list or flat) and a reduce-scatter (list or flat)
//     of host tensors keep their tensors, reduction and root in the OpBody (SmallArgs, by OpKind)
//     instead of a capturing std::function, which would not fit std::function's inline buffer;
//     a list is moved in, and an allgather's comes back as its result.
//     Their block lists are the group's own vectors (reserved at construction), a buffer that
//     fits one window needs no slice list (Note [Windows]), and StagedTensors::may_stage
//     answers before any list is built for the staging checks. The other operations, and a
//     list holding strided tensors, still build a Run.
//   - The small operations other than the list allgather complete their Future with their one
//     output tensor (Future::Result): the std::vector<at::Tensor> that Work::result() hands out
//     is made when it is first asked for, and Work::wait() does not ask
//     (Future::wait_until_done).
//   - The Future and the Work are made with allocate_shared from PooledBlocks: blocks freed go
//     to a cache of the freeing thread and are taken from the allocating thread's cache, so a
//     caller that issues, waits and drops its Works on one thread reuses the same blocks with no
//     lock; when another thread frees them (the worker ran the op and dropped the last
//     reference), a full cache hands its blocks to a shared depot (one mutex) that an empty
//     cache takes from, and only beyond both caps are blocks given back to the heap.
//   - A caller that waits at once takes no lock either: its operation goes through the slot
//     (Note [The slot]) and its Future completes without one (Note [Completing without a lock]
//     in comm/work.cpp), counted in the same test. Other styles still take the queue's mutex to
//     hand operations to the worker.
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

}  // namespace

// Note [Waiter runs the operation]
// A caller that waits on a collective as soon as it issued it (the blocking style of MPI and of
// torch.distributed without async_op) would otherwise hand the operation to the worker thread
// and sleep until the worker hands the result back: two thread wake-ups per operation, which on
// a host with more runnable threads than cores cost more than a small collective itself. So
// Work::wait() (without a timeout of its own) calls progress(seq, ..., true): when the operation
// is the next one due (first in the queue, nothing running), the waiting thread takes it and
// runs it itself. Order is kept because only the first queued operation can be taken, and only
// one thread runs operations at a time (kRunning, Note [The slot]); the worker waits while it is
// set. The exchange and scratch are used by whichever thread set it. Continuations then run on
// the waiting thread.
//
// Waking the worker for each operation costs as much again (a futex wake on the caller, the
// worker scheduled onto a core the peer ranks need, only to find the operation taken): measured
// in docs/perf-history.md ("Waking a rank"), a third of a 4 KiB allreduce. So the group
// learns the caller's style:
//   - An operation whose wait() comes within kPromptWait of its issue, while it is still queued,
//     is "waited promptly". After kPromptStreak such operations in a row the group turns lazy_:
//     new operations are queued without waking the worker (worker_told = false, or the slot),
//     for their waiter to run.
//   - Anything else is asynchronous use and turns lazy_ off at once, telling the worker of every
//     operation it was not told of: a wait() that comes later than kPromptWait, and every other
//     look at a pending operation (wait with a timeout, is_completed, future(): DDP's buckets
//     and comm hooks, dropping the Work). A prompt wait() that cannot take its operation (another
//     is ahead or running) tells the worker too.
//   - While lazy_, the worker sleeps kLazyPickup at a time and runs an operation nobody has
//     claimed for that long, turning lazy_ off (a caller that issued and then computed). After
//     kLazyIdleRounds empty rounds it turns lazy_ off and sleeps until told, so an idle group
//     does not keep waking. A blocking caller's operations leave the queue empty at every
//     round too, so under such a caller the worker turns lazy_ off every kLazyIdleRounds
//     rounds and sleeps until told; the caller's next operations are told to it, and its prompt
//     waits turn lazy_ on again. The wait that does so wakes a worker asleep until told
//     (worker_untimed_), so that it goes back to its rounds: without that, a worker that looked
//     at lazy_ just before it turned on would sleep through an operation nobody touches.
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

// Note [The slot]
// A blocking caller (lazy_) pushes, waits and runs its operation with no lock: the queue keeps
// one operation outside queue_, in slot_, and one atomic word (state_) says who holds what:
// kRunning (an operation executes), kFilling (a push is writing slot_), kSlot (slot_ holds an
// operation nobody took), kQueued (queue_ is not empty), and above them the next seq. Each
// change is one compare-and-swap that also checks what it relies on:
//   - A push may use the slot only when no bit is set: nothing runs, nothing waits in the slot
//     or the queue. Its CAS sets kFilling and takes a seq; it writes slot_, then turns kFilling
//     into kSlot (release). Every other push (not lazy, or a bit set) goes to queue_ under mu_ and
//     sets kQueued in the CAS that takes its seq, so a slot operation always comes before every
//     queued one: a queued operation is taken only while kSlot and kFilling are clear.
//   - Taking the slot's operation: CAS from a value with kSlot and without kRunning to one with
//     kRunning and without kSlot; it fails if anything changed, the seq included, so an operation
//     taken, run and replaced meanwhile is never taken twice. Taking queue_'s first operation
//     sets kRunning (and clears kQueued when the queue empties) under mu_.
//   - The thread that ran the slot's operation resets slot_, then clears kRunning; only when
//     kQueued or kSlot was set meanwhile does it take mu_, to wake the worker if it has work.
//   - Destroying the group sets stop_ and then reads state_ (both seq_cst); a push reads stop_
//     after its CAS, so one of them sees the other: stop() reports the operation pending (the
//     group aborts and fail_queued fails it), or the push gives the slot back and fails as a
//     push under mu_ does. A push that finds the queue aborted or stopped after filling the
//     slot wakes the worker, which fails a slot's operation once the queue is aborted.
// So a caller that issues and waits at once takes no lock in the queue; the Future it waits on
// takes none either when nobody else listens (Future::finish in comm/work.cpp).

OpQueue::OpQueue(int rank, bool run_on_waiter, Runner& runner)
    : rank_(rank), run_on_waiter_(run_on_waiter), runner_(runner) {}

OpQueue::~OpQueue() {
  stop();
  join();
}

void OpQueue::join() {
  if (worker_.joinable()) worker_.join();
}

void OpQueue::start() {
  worker_ = std::thread([this] { worker_loop(); });
}

bool OpQueue::stop() {
  bool busy;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
    busy = (state_.load() & (kRunning | kFilling | kSlot | kQueued)) != 0;
  }
  cv_.notify_all();
  return busy;
}

std::exception_ptr OpQueue::aborted_error(const char* name, uint64_t seq) const {
  std::string cause;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (abort_cause_) cause = exception_message(abort_cause_);
  }
  return std::make_exception_ptr(Error(str("rank ", rank_, ": ", name, " (seq ", seq,
                                           ") failed: the process group was aborted",
                                           cause.empty() ? "" : " after: ", cause)));
}

bool OpQueue::abort(std::exception_ptr cause) {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_.load()) return false;
  abort_cause_ = std::move(cause);
  aborted_.store(true);
  return true;
}

void OpQueue::fail_queued() {
  NodeList pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending.swap(queue_);
    state_.fetch_and(~kQueued);
  }
  for (auto& node : pending) node.future->set_error(aborted_error(node.op.name, node.op.seq));
  // The slot's operation, once its push has written it: taken and run, it fails at once.
  for (;;) {
    uint64_t s = state_.load(std::memory_order_acquire);
    if ((s & kFilling) != 0) {
      std::this_thread::yield();
      continue;
    }
    if ((s & (kSlot | kRunning)) != kSlot) break;  // kSlot never comes with kRunning
    if (take_slot(s)) {
      execute(slot_, nullptr, Clock::now());
      break;
    }
  }
  cv_.notify_all();
}

bool OpQueue::push_to_slot(const char* name, Millis timeout, Clock::time_point enqueued,
                           OpBody& body, const std::shared_ptr<Future>& future, uint64_t* seq) {
  uint64_t s = state_.load(std::memory_order_relaxed);
  if ((s & kFlags) != 0 || !lazy_.load(std::memory_order_relaxed) || aborted_.load() ||
      !state_.compare_exchange_strong(s, (s + kSeqOne) | kFilling)) {
    return false;
  }
  if (stop_.load()) {
    // Note [The slot]: stop() may not have seen this push. The slot goes back, a worker
    // waiting to end is woken, and push() fails under mu_.
    state_.fetch_and(~kFilling);
    wake_worker();
    return false;
  }
  *seq = s >> kSeqShift;
  slot_.fill(name, *seq, timeout, enqueued, body, future);
  slot_seq_.store(*seq, std::memory_order_relaxed);
  slot_enqueued_.store(enqueued.time_since_epoch().count(), std::memory_order_relaxed);
  slot_told_.store(false, std::memory_order_relaxed);
  state_.fetch_xor(kFilling | kSlot);  // kFilling off, kSlot on (release)
  if (aborted_.load() || stop_.load()) wake_worker();
  return true;
}

std::shared_ptr<Work> OpQueue::push(const char* name, Millis timeout, OpBody&& body) {
  // Note [Small operations]: pooled Future and Work, the slot or a recycled node.
  auto future = std::allocate_shared<Future>(PoolAllocator<Future>());
  const auto enqueued = Clock::now();
  uint64_t seq;
  bool aborted = false, tell = false;
  if (!push_to_slot(name, timeout, enqueued, body, future, &seq)) {
    std::lock_guard<std::mutex> lock(mu_);
    TDIST_CHECK(!stop_.load(), "the process group is being destroyed");
    aborted = aborted_.load();
    // Only this thread (holding mu_) sets kQueued; the CAS takes the seq with it.
    uint64_t s = state_.load(std::memory_order_relaxed);
    while (!state_.compare_exchange_weak(s, (s + kSeqOne) | (aborted ? 0 : kQueued))) {}
    seq = s >> kSeqShift;
    if (!aborted) {
      if (free_ops_.empty()) free_ops_.emplace_back();
      queue_.splice(queue_.end(), free_ops_, free_ops_.begin());
      Node& node = queue_.back();
      node.fill(name, seq, timeout, enqueued, body, future);
      tell = node.worker_told = !lazy_.load(std::memory_order_relaxed);
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

bool OpQueue::take_slot(uint64_t s) {
  if ((s & (kSlot | kRunning)) != kSlot) return false;
  return state_.compare_exchange_strong(s, (s & ~kSlot) | kRunning, std::memory_order_acquire);
}

bool OpQueue::take_front_locked(uint64_t s, NodeList& taken) {
  if ((s & (kRunning | kFilling | kSlot)) != 0 || queue_.empty()) return false;
  const bool last = std::next(queue_.begin()) == queue_.end();
  if (!state_.compare_exchange_strong(s, (s | kRunning) & ~(last ? kQueued : 0))) return false;
  taken.splice(taken.end(), queue_, queue_.begin());
  return true;
}

bool OpQueue::tell_worker_locked() {
  bool told = false;
  for (auto& node : queue_) {
    if (!node.worker_told) node.worker_told = told = true;
  }
  if ((state_.load() & kSlot) != 0 && !slot_told_.load()) {
    slot_told_.store(true);
    told = true;
  }
  return told;
}

void OpQueue::tell_worker() {
  bool tell;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tell = tell_worker_locked();
  }
  if (tell) cv_.notify_one();
}

void OpQueue::wake_worker() {
  // Taking mu_ waits out a worker between its look at the state and its sleep.
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();
}

bool OpQueue::worker_has_work_locked() const {
  const uint64_t s = state_.load();
  if ((s & kRunning) != 0) return false;
  if ((s & kSlot) != 0) return slot_told_.load();
  return (s & kFilling) == 0 && !queue_.empty() && queue_.front().worker_told;
}

bool OpQueue::note_wait(bool prompt) {
  // Plain loads and stores: waits on one group come from its callers one at a time, and a lost
  // update only delays the switch by an operation.
  if (!prompt) {
    if (lazy_.load(std::memory_order_relaxed)) lazy_.store(false, std::memory_order_relaxed);
    prompt_waits_.store(0, std::memory_order_relaxed);
    return false;
  }
  const int n = prompt_waits_.load(std::memory_order_relaxed);
  if (n < kPromptStreak) prompt_waits_.store(n + 1, std::memory_order_relaxed);
  if (n + 1 >= kPromptStreak && !lazy_.load(std::memory_order_relaxed)) {
    lazy_.store(true);
    return worker_untimed_.load();
  }
  return false;
}

void OpQueue::progress(uint64_t seq, bool may_run_here) {
  uint64_t s = state_.load(std::memory_order_acquire);
  if ((s & kSlot) != 0 && slot_seq_.load(std::memory_order_relaxed) == seq) {
    // Note [The slot]: the op waits in the slot; running it here takes no lock.
    Clock::time_point now;
    bool prompt = false;
    if (may_run_here) {
      now = Clock::now();
      prompt = now.time_since_epoch().count() - slot_enqueued_.load(std::memory_order_relaxed) <=
               Clock::duration(kPromptWait).count();
    }
    if (note_wait(prompt)) wake_worker();
    if (may_run_here && !stop_.load(std::memory_order_relaxed) && take_slot(s)) {
      // Leaving lazy use, the worker must know of the ops queued behind this one.
      if ((s & kQueued) != 0 && !lazy_.load(std::memory_order_relaxed)) tell_worker();
      execute(slot_, nullptr, now);
      return;
    }
    tell_worker();  // not taken here: the worker runs it
    return;
  }
  NodeList taken;
  bool tell = false;
  Clock::time_point now;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // An operation no longer queued was taken already: not a prompt wait.
    bool prompt = false;
    if (may_run_here) {
      for (const auto& queued : queue_) {
        if (queued.op.seq != seq) continue;
        now = Clock::now();
        prompt = now - queued.op.enqueued <= kPromptWait;
        break;
      }
    }
    tell = note_wait(prompt);  // the worker cannot be between its look at lazy_ and its sleep
    if (may_run_here && !stop_.load() && !queue_.empty() && queue_.front().op.seq == seq) {
      take_front_locked(state_.load(), taken);
    }
    // Outside lazy use the worker knows every queued op; and if this one could not be taken
    // here, the worker must run it (after those ahead of it).
    if (!lazy_.load(std::memory_order_relaxed) || taken.empty()) tell |= tell_worker_locked();
  }
  if (tell) cv_.notify_one();
  if (!taken.empty()) execute(taken.front(), &taken, now);
}

void OpQueue::worker_loop() {
  int idle_rounds = 0;
  const auto unclaimed = [](Clock::time_point enqueued) {
    return Clock::now() - enqueued >= kLazyPickup;
  };
  for (;;) {
    NodeList taken;
    bool from_slot = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      for (;;) {
        const uint64_t s = state_.load(std::memory_order_acquire);
        if (stop_.load() && queue_.empty() && (s & (kFilling | kSlot)) == 0) return;
        // Not while a waiter runs an operation (Note [Waiter runs the operation]). The slot's
        // op comes first (Note [The slot]); once the queue is aborted it is failed here, since
        // nobody may be left to wait on it.
        if ((s & kSlot) != 0) {
          const bool due = slot_told_.load() || aborted_.load() ||
                           unclaimed(Clock::time_point(
                               Clock::duration(slot_enqueued_.load(std::memory_order_relaxed))));
          if (due && take_slot(s)) {
            from_slot = true;
            break;
          }
          if (due && (s & kRunning) == 0) continue;  // state_ changed under us: look again
        } else if (!queue_.empty() &&
                   (queue_.front().worker_told || unclaimed(queue_.front().op.enqueued)) &&
                   take_front_locked(s, taken)) {
          break;
        }
        if (!lazy_.load()) {
          // Note [Waiter runs the operation]: note_wait() reads worker_untimed_ after it sets
          // lazy_ (both seq_cst), so it sees this sleep or this thread sees lazy_ set.
          worker_untimed_.store(true);
          if (!lazy_.load()) cv_.wait(lock);
          worker_untimed_.store(false);
          continue;
        }
        if (cv_.wait_for(lock, kLazyPickup) == std::cv_status::timeout && queue_.empty() &&
            (state_.load() & (kFilling | kSlot)) == 0 && ++idle_rounds >= kLazyIdleRounds) {
          lazy_.store(false, std::memory_order_relaxed);
          prompt_waits_.store(0, std::memory_order_relaxed);
        }
      }
      idle_rounds = 0;
      // Nobody claimed it within kLazyPickup: the caller is asynchronous.
      if (from_slot ? !slot_told_.load() : !taken.front().worker_told) {
        lazy_.store(false, std::memory_order_relaxed);
        prompt_waits_.store(0, std::memory_order_relaxed);
        tell_worker_locked();
      }
    }
    if (from_slot) {
      execute(slot_, nullptr, Clock::now());
    } else {
      execute(taken.front(), &taken, Clock::now());
    }
  }
}

void OpQueue::finish_running(Node& node, NodeList* list) {
  static constexpr size_t kFreeOpsCap = 16;
  node.future.reset();
  node.op.body = OpBody{};  // the caller's tensors and the Run's captures are not kept
  node.worker_told = false;
  bool more;
  if (list == nullptr) {
    // The slot (Note [The slot]): written by the next push once kRunning is clear.
    const uint64_t before = state_.fetch_and(~kRunning, std::memory_order_acq_rel);
    if ((before & (kQueued | kSlot)) == 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    more = worker_has_work_locked();
  } else {
    std::lock_guard<std::mutex> lock(mu_);
    state_.fetch_and(~kRunning, std::memory_order_acq_rel);
    more = worker_has_work_locked();
    if (free_ops_.size() < kFreeOpsCap) free_ops_.splice(free_ops_.end(), *list);
  }
  // The worker waits for kRunning to clear when a waiter ran the operation.
  if (more) cv_.notify_one();
}

void OpQueue::execute(Node& node, NodeList* list, Clock::time_point now) {
  Op& op = node.op;
  const char* name = op.name;
  const uint64_t seq = op.seq;
  std::shared_ptr<Future> future = std::move(node.future);
  if (aborted_.load()) {
    finish_running(node, list);
    future->set_error(aborted_error(name, seq));
    return;
  }
  Future::Result value;
  std::exception_ptr error;
  try {
    value = runner_.run(op, now);
  } catch (const MismatchError&) {
    error = std::current_exception();
  } catch (...) {
    error = std::current_exception();
    // The byte streams are no longer in step (or a peer is gone): nothing later can succeed.
    runner_.fatal(error);
  }
  // Before completing: a caller that waited for this op may destroy the group at once, and
  // must not find it busy. The op's own references (its Run's captures, its tensors) go with it.
  finish_running(node, list);
  try {
    if (error) {
      future->set_error(error);
    } else {
      future->set_result(std::move(value));
    }
  } catch (const std::exception& e) {
    TDIST_LOG_ERROR("rank ", rank_, ": a continuation of ", name, " (seq ", seq,
                    ") threw: ", e.what());
  }
}

}  // namespace tdist::comm::detail
