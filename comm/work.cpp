#include "tdist/comm/work.h"

#include <chrono>

#include "tdist/core/error.h"

namespace tdist::comm {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
      return "SUM";
    case ReduceOp::AVG:
      return "AVG";
    case ReduceOp::PRODUCT:
      return "PRODUCT";
    case ReduceOp::MIN:
      return "MIN";
    case ReduceOp::MAX:
      return "MAX";
    case ReduceOp::BAND:
      return "BAND";
    case ReduceOp::BOR:
      return "BOR";
    case ReduceOp::BXOR:
      return "BXOR";
  }
  return "?";
}

std::shared_ptr<Future> Future::completed(Value value) {
  auto f = std::make_shared<Future>();
  f->set_value(std::move(value));
  return f;
}

std::shared_ptr<Future> Future::failed(std::exception_ptr error) {
  auto f = std::make_shared<Future>();
  f->set_error(std::move(error));
  return f;
}

void Future::set_value(Value value) {
  std::unique_lock<std::mutex> lock(mu_);
  TDIST_CHECK(!done_, "Future completed twice");
  value_ = std::move(value);
  finish(lock);
}

void Future::set_result(Result result) {
  if (!result.single) return set_value(std::move(result.list));
  std::unique_lock<std::mutex> lock(mu_);
  TDIST_CHECK(!done_, "Future completed twice");
  one_ = std::move(result.one);
  listed_.store(false, std::memory_order_relaxed);  // published by done_'s release
  finish(lock);
}

void Future::set_error(std::exception_ptr error) {
  std::unique_lock<std::mutex> lock(mu_);
  TDIST_CHECK(!done_, "Future completed twice");
  TDIST_CHECK(error != nullptr, "Future::set_error needs an error");
  error_ = std::move(error);
  finish(lock);
}

void Future::finish(std::unique_lock<std::mutex>& lock) {
  done_.store(true, std::memory_order_release);
  auto callbacks = std::move(callbacks_);
  callbacks_.clear();
  lock.unlock();
  cv_.notify_all();
  // Callbacks run without the lock: they may call value(), then() or wait() on this future.
  for (auto& cb : callbacks) cb(*this);
}

bool Future::completed() const { return done_.load(std::memory_order_acquire); }

bool Future::has_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_ && error_ != nullptr;
}

std::exception_ptr Future::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

const Future::Value& Future::listed(std::unique_lock<std::mutex>* lock) const {
  if (listed_.load(std::memory_order_acquire)) return value_;
  std::unique_lock<std::mutex> own;
  if (lock == nullptr) own = std::unique_lock<std::mutex>(mu_);
  if (!listed_.load(std::memory_order_relaxed)) {
    value_.assign(1, one_);
    listed_.store(true, std::memory_order_release);
  }
  return value_;
}

const Future::Value& Future::wait(Millis timeout) {
  wait_until_done(timeout);
  return listed();
}

void Future::wait_until_done(Millis timeout) {
  // error_ is constant once done_ is set (with release, after it).
  if (done_.load(std::memory_order_acquire)) {
    if (error_) std::rethrow_exception(error_);
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (timeout.count() < 0) {
    cv_.wait(lock, [&] { return done_.load(); });
  } else if (!cv_.wait_for(lock, timeout, [&] { return done_.load(); })) {
    TDIST_THROW(TimeoutError, "timed out after ", timeout.count(),
                " ms waiting for the operation to complete (it keeps running until its own "
                "deadline)");
  }
  if (error_) std::rethrow_exception(error_);
}

const Future::Value& Future::value() const {
  std::unique_lock<std::mutex> lock(mu_);
  TDIST_CHECK(done_, "Future::value() called before the future completed");
  if (error_) std::rethrow_exception(error_);
  return listed(&lock);
}

std::shared_ptr<Future> Future::then(std::function<Value(Future&)> fn) {
  auto next = std::make_shared<Future>();
  add_callback([next, fn = std::move(fn)](Future& self) {
    if (auto err = self.error()) {
      next->set_error(err);
      return;
    }
    Value result;
    try {
      result = fn(self);
    } catch (...) {
      next->set_error(std::current_exception());
      return;
    }
    next->set_value(std::move(result));
  });
  return next;
}

void Future::add_callback(std::function<void(Future&)> fn) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!done_) {
    callbacks_.push_back(std::move(fn));
    return;
  }
  lock.unlock();
  fn(*this);
}

}  // namespace tdist::comm
