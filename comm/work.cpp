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

// Note [Completing without a lock]
// A Future completed on one thread and waited on by the thread that completed it (a blocking
// caller that ran its own operation: Note [Waiter runs the operation] in
// comm/ring/op_queue.cpp) has nobody to wake, so completing takes no lock unless someone
// listens. state_ holds kClaimed (a set_* call owns the value fields), kDone (they are written
// and constant) and kListening (a callback or a blocked waiter registered under mu_):
//   - set_*: claim (kClaimed, once), write the fields, then set kDone (release). Only if
//     kListening was set before that does it take mu_ to wake the waiters and take the callbacks.
//   - add_callback and a blocking wait: under mu_, set kListening; if kDone was set already they
//     run or return at once, else they register (the callback) or sleep on cv_ (the waiter).
// The two read-modify-writes are ordered: either the listener saw kDone, or the completing
// thread saw kListening and takes mu_, which it gets only once the listener has registered or
// is asleep on cv_.
void Future::claim() {
  TDIST_CHECK((state_.fetch_or(kClaimed, std::memory_order_acquire) & kClaimed) == 0,
              "Future completed twice");
}

void Future::set_value(Value value) {
  claim();
  value_ = std::move(value);
  finish();
}

void Future::set_result(Result result) {
  if (!result.single) return set_value(std::move(result.list));
  claim();
  one_ = std::move(result.one);
  listed_.store(false, std::memory_order_relaxed);  // published by kDone's release
  finish();
}

void Future::set_error(std::exception_ptr error) {
  TDIST_CHECK(error != nullptr, "Future::set_error needs an error");
  claim();
  error_ = std::move(error);
  finish();
}

void Future::finish() {
  if ((state_.fetch_or(kDone, std::memory_order_acq_rel) & kListening) == 0) return;
  std::vector<std::function<void(Future&)>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    callbacks.swap(callbacks_);
  }
  cv_.notify_all();
  // Callbacks run without the lock: they may call value(), then() or wait() on this future.
  for (auto& cb : callbacks) cb(*this);
}

bool Future::completed() const { return (state_.load(std::memory_order_acquire) & kDone) != 0; }

bool Future::has_error() const { return completed() && error_ != nullptr; }

std::exception_ptr Future::error() const { return completed() ? error_ : nullptr; }

const Future::Value& Future::listed() const {
  if (listed_.load(std::memory_order_acquire)) return value_;
  std::lock_guard<std::mutex> lock(mu_);
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
  if (!completed()) {
    std::unique_lock<std::mutex> lock(mu_);
    state_.fetch_or(kListening, std::memory_order_acq_rel);
    if (timeout.count() < 0) {
      cv_.wait(lock, [&] { return completed(); });
    } else if (!cv_.wait_for(lock, timeout, [&] { return completed(); })) {
      TDIST_THROW(TimeoutError, "timed out after ", timeout.count(),
                  " ms waiting for the operation to complete (it keeps running until its own "
                  "deadline)");
    }
  }
  // error_ is constant once kDone is seen.
  if (error_) std::rethrow_exception(error_);
}

const Future::Value& Future::value() const {
  TDIST_CHECK(completed(), "Future::value() called before the future completed");
  if (error_) std::rethrow_exception(error_);
  return listed();
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    if ((state_.fetch_or(kListening, std::memory_order_acq_rel) & kDone) == 0) {
      callbacks_.push_back(std::move(fn));
      return;
    }
  }
  fn(*this);
}

}  // namespace tdist::comm
