#pragma once
// Future<T>: the result of rpc_async, of an RRef's asynchronous calls and of then().
//
// Holds a value or an exception_ptr. wait(timeout) blocks until it is done, then rethrows the
// stored error; value() waits and returns the value. then(f) runs f(future) once it is done and
// returns a Future of f's result (an exception thrown by f becomes that future's error).
// Callbacks run on the thread that completes the future, or on the agent's worker threads when
// the agent completes it from a connection's reader thread (user code never runs on a reader).
// Thread safety: all methods may be called from any thread; copies share one state.

#include <chrono>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tdist/core/error.h"
#include "tdist/core/store.h"
#include "tdist/rpc/detail/future_state.h"

namespace tdist::rpc {

template <class T>
class Future {
 public:
  using value_type = T;
  static constexpr std::chrono::microseconds kSpin{50};

  Future() : state_(std::make_shared<detail::FutureState<T>>()) {}

  bool done() const {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->done;
  }

  // Blocks until done (timeout 0: no limit), then rethrows the stored error. TimeoutError when
  // the timeout passes first (the future stays pending).
  void wait(Millis timeout = Store::kNoTimeout) const {
    // A reply to a small call usually lands within tens of microseconds: spin briefly, yielding
    // the core to the threads that bring it (the reader, on a host with few cores), before
    // sleeping on the condition variable, whose wake-up costs about as much as the call.
    const auto spin_until = std::chrono::steady_clock::now() + kSpin;
    while (!state_->ready.load(std::memory_order_acquire) &&
           std::chrono::steady_clock::now() < spin_until) {
      std::this_thread::yield();
    }
    std::unique_lock<std::mutex> lock(state_->mu);
    if (timeout.count() > 0) {
      if (!state_->cv.wait_for(lock, timeout, [&] { return state_->done; })) {
        throw TimeoutError(
            str("waited ", timeout.count(), " ms for ",
                state_->description.empty() ? std::string("a future") : state_->description,
                " without a result"));
      }
    } else {
      state_->cv.wait(lock, [&] { return state_->done; });
    }
    if (state_->error) std::rethrow_exception(state_->error);
  }

  // Waits (without limit; calls made through the agent fail by their own timeout), rethrows the
  // error, and returns the value.
  template <class U = T, std::enable_if_t<!std::is_void_v<U>, int> = 0>
  const U& value() const {
    wait();
    return *state_->value;
  }

  // The error once done with one; nullptr otherwise. Does not block.
  std::exception_ptr error() const {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->error;
  }

  // Runs f(*this) once done; returns a Future of f's result.
  template <class F>
  auto then(F&& f) const -> Future<std::invoke_result_t<F, Future<T>>> {
    using U = std::invoke_result_t<F, Future<T>>;
    Future<U> next;
    Future<T> self = *this;
    auto cb = [self, next, fn = std::forward<F>(f)]() mutable {
      try {
        if constexpr (std::is_void_v<U>) {
          fn(self);
          next.set_value();
        } else {
          next.set_value(fn(self));
        }
      } catch (...) {
        next.set_error(std::current_exception());
      }
    };
    {
      std::unique_lock<std::mutex> lock(state_->mu);
      if (!state_->done) {
        state_->callbacks.emplace_back(std::move(cb));
        return next;
      }
    }
    cb();
    return next;
  }

  // Completion (used by the agent; the first completion wins).
  template <class U = T, std::enable_if_t<!std::is_void_v<U>, int> = 0>
  bool set_value(U v, detail::Executor* executor = nullptr) const {
    return state_->complete(std::optional<U>(std::move(v)), nullptr, executor);
  }
  template <class U = T, std::enable_if_t<std::is_void_v<U>, int> = 0>
  bool set_value(detail::Executor* executor = nullptr) const {
    return state_->complete(std::optional<bool>(true), nullptr, executor);
  }
  bool set_error(std::exception_ptr e, detail::Executor* executor = nullptr) const {
    return state_->complete(std::nullopt, std::move(e), executor);
  }
  void set_description(std::string d) const { state_->description = std::move(d); }

 private:
  std::shared_ptr<detail::FutureState<T>> state_;
};

}  // namespace tdist::rpc
