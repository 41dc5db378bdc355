#pragma once
// OpQueue: the ring backend's queue of collectives, and who runs them. Operations run one at a
// time in the order they were pushed, on the queue's worker thread or on a thread that waits on
// one (Note [Waiter runs the operation] in op_queue.cpp); what an operation does is the Runner's
// business (RingProcessGroup). The queue holds each operation from push() until its Future
// completes, fails every queued one when the queue is aborted, and never blocks on a peer.
//
// Thread safety: every public method may be called from any thread.

#include <atomic>
#include <condition_variable>
#include <exception>
#include <list>
#include <memory>
#include <mutex>
#include <thread>

#include "tdist/comm/ring/op_body.h"
#include "tdist/comm/types.h"
#include "tdist/comm/work.h"

namespace tdist::comm::detail {

class OpQueue {
 public:
  struct Op {
    const char* name = nullptr;  // a string literal (Work::StaticName)
    uint64_t seq = 0;
    Millis timeout{0};
    Clock::time_point enqueued;
    OpBody body;
  };
  // What the queue runs operations with; called on the thread that took the operation.
  class Runner {
   public:
    virtual ~Runner() = default;
    // Runs `op`, whose deadline counts from `began`; returns its value or throws. The op is the
    // caller's alone until it returns.
    virtual Future::Result run(Op& op, Clock::time_point began) = 0;
    // `run` threw something other than a MismatchError: nothing later can succeed, so the group
    // aborts (which calls abort() here).
    virtual void fatal(std::exception_ptr error) = 0;
  };

  // `rank` names this rank in errors. run_on_waiter: Note [Waiter runs the operation].
  OpQueue(int rank, bool run_on_waiter, Runner& runner);
  // Stops the queue and joins the worker when that was not done.
  ~OpQueue();
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  // Starts the worker thread; operations pushed before wait for it.
  void start();
  // Queues an operation (`timeout` is its own, already resolved against the group's) and returns
  // its Work at once: already failed when the queue is aborted. Error when stop() was called.
  std::shared_ptr<Work> push(const char* name, Millis timeout, OpBody&& body);

  // Marks the queue aborted, remembering `cause` for the errors of later operations; false when
  // it was aborted already. Operations queued then fail in fail_queued(), and any that is taken
  // before fails at once instead of running.
  bool abort(std::exception_ptr cause);
  // Fails every operation still queued (after abort()).
  void fail_queued();
  // Set once abort() was called (the Exchange stops waiting on it).
  const std::atomic<bool>& aborted() const { return aborted_; }
  // The error of operation `name` (seq) of an aborted queue, naming the abort's cause.
  std::exception_ptr aborted_error(const char* name, uint64_t seq) const;

  // No operation may be pushed any more; the worker ends once the queue is empty. Returns whether
  // an operation was queued or running (the group then aborts, so that they end).
  bool stop();
  // Waits for the worker to end (after stop()); not from an operation's thread.
  void join();

 private:
  // A queued op and the queue's bookkeeping. Nodes move between queue_, the thread running
  // them and free_ops_ by splicing, so a warm queue takes an operation without allocating.
  struct Node {
    Op op;
    std::shared_ptr<Future> future;
    bool worker_told = false;  // guarded by mu_: the worker was notified of this op
    // Takes a pushed op (its body moved in).
    void fill(const char* name, uint64_t seq, Millis timeout, Clock::time_point enqueued,
              OpBody& body, const std::shared_ptr<Future>& f) {
      op.name = name;
      op.seq = seq;
      op.timeout = timeout;
      op.enqueued = enqueued;
      op.body = std::move(body);
      future = f;
    }
  };
  using NodeList = std::list<Node>;

  // state_'s bits (Note [The slot] in op_queue.cpp); the bits above them count the operations
  // pushed (the next one's seq).
  static constexpr uint64_t kRunning = 1;  // an op is executing (worker or waiter)
  static constexpr uint64_t kFilling = 2;  // a push is writing its op into slot_
  static constexpr uint64_t kSlot = 4;     // slot_ holds an op nobody has taken
  static constexpr uint64_t kQueued = 8;   // queue_ holds ops (changed only under mu_)
  static constexpr uint64_t kFlags = 15;
  static constexpr uint64_t kSeqOne = 16;
  static constexpr int kSeqShift = 4;

  // push() into slot_ without a lock when the queue is idle and lazy; false: push under mu_.
  bool push_to_slot(const char* name, Millis timeout, Clock::time_point enqueued, OpBody& body,
                    const std::shared_ptr<Future>& future, uint64_t* seq);
  // Takes slot_'s op (which `s`, state_'s value seen, says is there) to run on this thread;
  // false when state_ is no longer `s`.
  bool take_slot(uint64_t s);
  // Takes queue_'s first op into `taken` to run on this thread, when nothing runs or waits in
  // the slot (`s`: state_'s value seen); false when it may not. Call with mu_ held.
  bool take_front_locked(uint64_t s, NodeList& taken);
  // Note [Waiter runs the operation]: the Work's progress hook.
  void progress(uint64_t seq, bool may_run_here);
  // A wait on an op that found it `prompt` or not: Note [Waiter runs the operation]. True when
  // it turned lazy_ on while the worker sleeps until told: wake it (wake_worker(), or a
  // notification after releasing mu_ when the caller holds it).
  bool note_wait(bool prompt);
  void worker_loop();
  // Runs the op of `node`, held alone by this thread: taken from queue_ into `list`, or from the
  // slot (list == nullptr); `now`: when it starts. The node is free again before the op's future
  // completes.
  void execute(Node& node, NodeList* list, Clock::time_point now);
  // Notes the op of `node` done (kRunning clear) and takes the node back (its op reset).
  void finish_running(Node& node, NodeList* list);
  // Notifies the worker of every queued op it was not told of; call with mu_ held, then notify
  // cv_ when it returns true.
  bool tell_worker_locked();
  // tell_worker_locked() under mu_, and the notification.
  void tell_worker();
  // Wakes the worker to look at the state again; call without mu_.
  void wake_worker();
  // An op the worker was told of is next and nothing runs. Call with mu_ held.
  bool worker_has_work_locked() const;

  // Constant after construction.
  const int rank_;
  const bool run_on_waiter_;
  Runner& runner_;

  std::atomic<bool> aborted_{false};
  std::atomic<uint64_t> state_{0};
  std::atomic<bool> stop_{false};  // written under mu_
  // Heuristics of Note [Waiter runs the operation]; read and written without a lock (a stale
  // value costs a wake-up or a pickup delay, never an operation).
  std::atomic<bool> lazy_{false};            // new ops are left for their waiter
  std::atomic<int> prompt_waits_{0};         // ops waited on promptly in a row
  std::atomic<bool> worker_untimed_{false};  // the worker sleeps until told (not lazy_)
  // The slot: one op, written by the push that set kFilling, then the thread that took it
  // (kSlot cleared, kRunning set) until it clears kRunning. Its seq, push time and whether
  // the worker was told are atomics, read by threads that do not own it.
  Node slot_;
  std::atomic<uint64_t> slot_seq_{0};
  std::atomic<int64_t> slot_enqueued_{0};  // Clock ticks
  std::atomic<bool> slot_told_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  NodeList queue_;                  // guarded by mu_
  NodeList free_ops_;               // guarded by mu_: reset nodes for later operations
  std::exception_ptr abort_cause_;  // guarded by mu_
  std::thread worker_;
};

}  // namespace tdist::comm::detail
