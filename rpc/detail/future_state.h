#pragma once
// The shared state behind rpc/future.h's Future<T> (copies of a Future share one), and the
// Executor that runs a completed future's callbacks (the agent's worker pool).
// Thread safety: FutureState's fields are guarded by its mu (ready mirrors done for a lock-free
// look); complete() runs the callbacks outside the lock.

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace tdist::rpc::detail {

// Runs tasks on other threads (the agent's worker pool).
class Executor {
 public:
  virtual ~Executor() = default;
  virtual void post(std::function<void()> task) = 0;
};

template <class T>
struct FutureState {
  using Stored = std::conditional_t<std::is_void_v<T>, bool, T>;

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  // Mirrors `done` for wait()'s lock-free spin (set under mu, after value/error).
  std::atomic<bool> ready{false};
  std::optional<Stored> value;
  std::exception_ptr error;
  std::vector<std::function<void()>> callbacks;
  std::string description;  // what the future waits for, for timeout messages

  // Returns false when the future was already done (the first completion wins).
  bool complete(std::optional<Stored> v, std::exception_ptr e, Executor* executor) {
    std::vector<std::function<void()>> cbs;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (done) return false;
      value = std::move(v);
      error = std::move(e);
      done = true;
      ready.store(true, std::memory_order_release);
      cbs.swap(callbacks);
    }
    cv.notify_all();
    for (auto& cb : cbs) {
      if (executor) {
        executor->post(std::move(cb));
      } else {
        cb();
      }
    }
    return true;
  }
};

}  // namespace tdist::rpc::detail
