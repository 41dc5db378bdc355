#pragma once
// Future and Work: the asynchronous results of process-group operations (c10d's model).
//
// Future: a value (a list of tensors) or an error, set once. then(fn) chains a continuation that
// runs when the future completes (at once, on the caller's thread, if it already has), and returns
// the continuation's own future; an exception thrown by fn fails that future. wait(timeout)
// blocks and rethrows the stored error. A future completed with one tensor (a Result) makes its
// list when the value is first asked for, so a caller that only waits allocates none (Note [Small
// operations] in comm/ring/op_queue.cpp). Thread safe.
//
// Work: one operation in flight. wait(timeout) blocks until the operation finished, rethrows its
// error (an Error naming the rank, the operation, the peer and the sequence number), and returns
// true (a CUDA backend's Work: see wait()); with a timeout that passes first it throws
// TimeoutError (the operation itself keeps its own deadline). result() gives the output
// tensors; future() completes with them (DDP's reducer and comm hooks chain on it). Thread safe.
//
// A backend may give a Work a progress hook (Note [Waiter runs the operation] in
// comm/ring/op_queue.cpp): wait() with no timeout of its own calls it with
// may_run_here=true, and the backend runs the operation on the waiting thread when nothing is
// ahead of it; every other way of looking at the result (wait with a timeout, is_completed,
// future, dropping the Work) calls it with false: the backend makes sure its worker runs the
// operation. The hook is only called while the operation is incomplete, so a Work that outlives
// its group (every pending operation is failed when a group is destroyed) never calls into it.

#include <ATen/core/Tensor.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tdist/comm/types.h"

namespace tdist::comm {

class Future : public std::enable_shared_from_this<Future> {
 public:
  using Value = std::vector<at::Tensor>;
  // What an operation completes with: a list, or one tensor kept as it is until the value's list
  // is first asked for.
  struct Result {
    Result() = default;
    // Implicit: a Run returns its Value, a small operation its output tensor.
    Result(Value list) : list(std::move(list)) {}
    Result(at::Tensor one) : one(std::move(one)), single(true) {}
    at::Tensor one;
    Value list;
    bool single = false;
  };

  Future() = default;
  static std::shared_ptr<Future> completed(Value value);
  static std::shared_ptr<Future> failed(std::exception_ptr error);

  void set_value(Value value);
  void set_result(Result result);
  void set_error(std::exception_ptr error);

  bool completed() const;
  bool has_error() const;
  std::exception_ptr error() const;

  // Blocks until complete; kUseGroupTimeout (or any negative value) waits forever.
  // Throws TimeoutError when `timeout` passes first; rethrows the stored error.
  const Value& wait(Millis timeout = Millis(-1));
  // wait() without asking for the value: a future completed with one tensor builds no list.
  void wait_until_done(Millis timeout = Millis(-1));
  // The value; the future must be complete. Rethrows the stored error.
  const Value& value() const;

  // Runs fn(*this) when complete. Its result completes the returned future; if it throws, or
  // this future failed, the returned future fails with that error (fn is not called on error).
  std::shared_ptr<Future> then(std::function<Value(Future&)> fn);
  // Runs fn(*this) when complete, success or failure; no new future.
  void add_callback(std::function<void(Future&)> fn);

 private:
  // state_'s bits: Note [Completing without a lock] in comm/work.cpp.
  static constexpr int kClaimed = 1;    // a set_* call owns the value fields
  static constexpr int kDone = 2;       // complete: the value fields are constant
  static constexpr int kListening = 4;  // a callback or a blocked waiter is registered (mu_)
  // Claims the value fields for one set_* call; throws when the future was completed before.
  void claim();
  // Publishes the value fields, then wakes the waiters and runs the callbacks if any.
  void finish();
  // The value of a complete future without an error; lists one_ the first time.
  const Value& listed() const;

  mutable std::mutex mu_;  // for listeners (callbacks_, cv_) and the first listing of one_
  std::condition_variable cv_;
  std::atomic<int> state_{0};
  // Written by the set_* call that claimed them, read once kDone is seen (acquire).
  mutable Value value_;  // made from one_ under mu_ when a single tensor is first asked for
  at::Tensor one_;
  mutable std::atomic<bool> listed_{true};  // false while a single tensor sits in one_ unlisted
  std::exception_ptr error_;
  std::vector<std::function<void(Future&)>> callbacks_;  // guarded by mu_
};

class Work {
 public:
  Work(std::string op, uint64_t seq, std::shared_ptr<Future> future)
      : op_(std::move(op)), seq_(seq), future_(std::move(future)) {}
  // A name that lives as long as the program (a string literal): kept as the pointer, so that
  // making the Work allocates nothing for a name longer than std::string's inline buffer (Note
  // [Small operations] in comm/ring/op_queue.cpp).
  struct StaticName {
    const char* name;
  };
  Work(StaticName op, uint64_t seq, std::shared_ptr<Future> future)
      : static_op_(op.name), seq_(seq), future_(std::move(future)) {}
  virtual ~Work() { progress(false); }

  bool is_completed() const {
    progress(false);
    return future_->completed();
  }
  bool is_success() const { return is_completed() && !future_->has_error(); }
  std::exception_ptr exception() const {
    progress(false);
    return future_->error();
  }
  // See the class comment. Millis(-1): wait as long as the operation's own timeout allows.
  // A CUDA backend's Work (NCCL) overrides it with c10d's stream semantics: the caller's current
  // CUDA stream waits for the operation, the CPU does not (synchronize() blocks the CPU).
  virtual bool wait(Millis timeout = Millis(-1)) {
    progress(timeout.count() < 0);
    future_->wait_until_done(timeout);
    return true;
  }
  // Blocks the calling thread until the operation finished (on the device too) and rethrows its
  // error. For CPU operations, and CUDA tensors staged through the CPU backend, it is wait().
  virtual void synchronize() { wait(); }
  // Set once, before the Work is handed out.
  void set_progress(std::function<void(bool may_run_here)> fn) { progress_ = std::move(fn); }
  const std::vector<at::Tensor>& result() const { return future_->value(); }
  std::shared_ptr<Future> future() const {
    progress(false);
    return future_;
  }
  // For adapters that pass each look of their own on through observe(): the future, without
  // counting as a look at the operation.
  std::shared_ptr<Future> future_unobserved() const { return future_; }
  void observe() const { progress(false); }
  // recv_any_source: the rank the message came from (valid once complete); -1 otherwise.
  virtual int source_rank() const { return -1; }

  std::string op() const { return static_op_ != nullptr ? std::string(static_op_) : op_; }
  uint64_t sequence_number() const { return seq_; }

 private:
  const std::string op_;  // unless static_op_ is set
  const char* const static_op_ = nullptr;
  const uint64_t seq_;
  const std::shared_ptr<Future> future_;
  void progress(bool may_run_here) const {
    if (progress_ && !future_->completed()) progress_(may_run_here);
  }

  std::function<void(bool)> progress_;
};

}  // namespace tdist::comm
