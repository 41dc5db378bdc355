#include "tdist/rpc/detail/thread_pool.h"

#include "tdist/core/logging.h"

namespace tdist::rpc::detail {
namespace {
thread_local const ThreadPool* tl_pool = nullptr;
// Set on a pool thread that called stop(): once its task returns, it leaves run() without
// touching the pool, which may be gone by then.
thread_local bool tl_released = false;
}  // namespace

ThreadPool::ThreadPool(int threads, std::function<void()> on_start, std::chrono::microseconds spin)
    : on_start_(std::move(on_start)), spin_(spin) {
  TDIST_CHECK_ARG(threads > 0, "a thread pool needs at least one thread, got ", threads);
  threads_.reserve(threads);
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
}

ThreadPool::~ThreadPool() { stop(); }

void ThreadPool::post(std::function<void()> task) {
  // After stop() nothing would run it: run it here rather than lose a future's callback.
  if (!try_post(std::move(task))) task();  // try_post leaves `task` alone when it refuses
}

bool ThreadPool::try_post(std::function<void()>&& task) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return false;
  tasks_.push_back(std::move(task));
  queued_.store(true, std::memory_order_release);
  // A spinning thread takes one task; any more need a sleeper. Notified under the lock: once it
  // is released, the task may already have run and destroyed the pool (ThreadSanitizer saw
  // notify_one() race with the condition variable's destruction in DestroyedFromItsOwnTask).
  if (idle_ > 0 && (!spinning_ || tasks_.size() > 1)) cv_.notify_one();
  return true;
}

void ThreadPool::stop() {
  const bool own = in_pool_thread();
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    stop_seen_.store(true, std::memory_order_release);
    threads.swap(threads_);
  }
  cv_.notify_all();
  for (auto& t : threads) {
    if (t.get_id() == std::this_thread::get_id()) {
      t.detach();
    } else if (t.joinable()) {
      t.join();
    }
  }
  if (!own) return;
  // The other threads drained the queue before they left; with none, this one runs the rest.
  for (;;) {
    std::function<void()> task;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (tasks_.empty()) break;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    run_task(task);
  }
  tl_pool = nullptr;
  tl_released = true;
}

void ThreadPool::spin_for_task() {
  const auto until = std::chrono::steady_clock::now() + spin_;
  while (!queued_.load(std::memory_order_acquire) && !stop_seen_.load(std::memory_order_acquire) &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::yield();
  }
}

bool ThreadPool::in_pool_thread() const { return tl_pool == this; }

void ThreadPool::run_task(std::function<void()>& task) {
  try {
    task();
  } catch (const std::exception& e) {
    TDIST_LOG_ERROR("rpc worker thread: task threw: ", e.what());
  } catch (...) {
    TDIST_LOG_ERROR("rpc worker thread: task threw a non-standard exception");
  }
  task = nullptr;
}

void ThreadPool::run() {
  tl_pool = this;
  if (on_start_) on_start_();
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    bool spun = false;  // once per task: a spin that ran out sleeps next
    while (tasks_.empty() && !stopping_) {
      if (spin_.count() > 0 && !spinning_ && !spun) {
        spun = true;
        spinning_ = true;
        lock.unlock();
        spin_for_task();
        lock.lock();
        spinning_ = false;
        continue;  // looks again under the lock before it sleeps
      }
      ++idle_;
      cv_.wait(lock);
      --idle_;
    }
    if (tasks_.empty()) return;  // stopping and drained
    auto task = std::move(tasks_.front());
    tasks_.pop_front();
    queued_.store(!tasks_.empty(), std::memory_order_release);
    lock.unlock();
    run_task(task);
    if (tl_released) return;  // this task stopped the pool: it may be destroyed already
    lock.lock();
  }
}

}  // namespace tdist::rpc::detail
