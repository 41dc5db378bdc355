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
  };
  using NodeList = std::list<Node>;

  void worker_loop();
  // Runs the op held alone in `node`; `now`: when it starts. The node goes back to free_ops_
  // before the op's future completes.
  void execute(NodeList& node, Clock::time_point now);
  // Note [Waiter runs the operation]: the Work's progress hook.
  void progress(uint64_t seq, bool may_run_here);
  // Notifies the worker of every queued op it was not told of; call with mu_ held, then notify
  // cv_ when it returns true.
  bool tell_worker_locked();
  // Clears running_ and takes back `node` (its op reset) into free_ops_.
  void finish_running(NodeList& node);

  // Constant after construction.
  const int rank_;
  const bool run_on_waiter_;
  Runner& runner_;

  std::atomic<bool> aborted_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  NodeList queue_;                  // guarded by mu_
  NodeList free_ops_;               // guarded by mu_: reset nodes for later operations
  uint64_t next_seq_ = 0;           // guarded by mu_
  bool running_ = false;            // guarded by mu_: an op is executing (worker or waiter)
  bool lazy_ = false;               // guarded by mu_: new ops are left for their waiter
  int prompt_waits_ = 0;            // guarded by mu_: ops waited on promptly in a row
  bool stop_ = false;               // guarded by mu_
  std::exception_ptr abort_cause_;  // guarded by mu_
  std::thread worker_;
};

}  // namespace tdist::comm::detail
