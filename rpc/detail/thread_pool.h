#pragma once
// A fixed pool of worker threads that run posted tasks in FIFO order. Each thread runs
// `on_start` first (the agent sets its thread-local current agent there). post() never blocks
// (the queue is unbounded) and wakes a thread only when one is idle. stop() finishes the queued
// tasks and joins the threads; after stop(), post() runs the task on the calling thread and
// try_post() runs nothing and returns false.
//
// A thread that finds the queue empty may spin for `spin` (yielding the core between looks)
// before it sleeps, one such thread at a time: a task posted meanwhile is taken without the
// condition variable's wake-up, which costs about as much as a small call's whole round trip
// (Note [RPC waits spin first] in rpc/agent.cpp). spin 0: every idle thread sleeps at once.
//
// stop() may be called from one of the pool's own tasks (the agent can be destroyed on its own
// worker thread): that thread cannot join itself, so stop() runs what is still queued on it,
// joins the other threads and returns; once the task returns, that thread leaves without
// touching the pool again. The pool may therefore be destroyed right after stop(), by any
// thread, including that task.
// Thread safety: post() from any thread, including the pool's own threads; stop() and the
// destructor from one thread at a time.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "tdist/rpc/future.h"

namespace tdist::rpc::detail {

class ThreadPool : public Executor {
 public:
  ThreadPool(int threads, std::function<void()> on_start,
             std::chrono::microseconds spin = std::chrono::microseconds(0));
  ~ThreadPool() override;

  void post(std::function<void()> task) override;
  bool try_post(std::function<void()>&& task);
  void stop();
  // True on the pool's own threads (while they belong to it).
  bool in_pool_thread() const;

 private:
  void run();
  static void run_task(std::function<void()>& task);

  // Spins until a task is queued, the pool stops, or `spin_` passes.
  void spin_for_task();

  std::function<void()> on_start_;
  const std::chrono::microseconds spin_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  int idle_ = 0;                             // sleeping threads; guarded by mu_
  bool spinning_ = false;                    // a thread spins for a task; guarded by mu_
  bool stopping_ = false;                    // guarded by mu_
  // Mirror tasks_.empty() and stopping_ for the spinning thread, which looks without mu_.
  std::atomic<bool> queued_{false};
  std::atomic<bool> stop_seen_{false};
  std::vector<std::thread> threads_;
};

}  // namespace tdist::rpc::detail
