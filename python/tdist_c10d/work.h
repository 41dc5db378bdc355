#pragma once
// WorkAdapter: the c10d::Work that the tdist backend returns to torch.distributed, over one or
// more tdist operations issued together (several for the coalesced variants).
//
// Note [Work and future adaptation]
// - The c10 future (getFuture()) is the single source of truth for completion: a callback on the
//   tdist future completes it with `outputs` (a List[Tensor], as Gloo's works do; DDP's reducer
//   reads element 0) or fails it with the error. isCompleted(), isSuccess() and exception() read
//   it, so a Work never looks complete before its future's value is readable.
// - wait(timeout) waits on the tdist future (so that a timeout given here applies; zero means
//   "as long as the operation's own deadline allows", c10d's kNoTimeout), rethrows its error,
//   then waits for the c10 future's completion, which the tdist callback performs at once.
//   With kNoTimeout it first waits on each tdist Work in turn, so that the waiting thread runs
//   an operation that is next due itself (Note [Waiter runs the operation]); waits on the
//   c10 future (getFuture().wait(), DDP's reducer) leave it to the progress thread.
// - The adapter chains on the tdist futures without counting as a look at the operations
//   (Work::future_unobserved), and passes on its own looks (isCompleted, isSuccess, exception,
//   getFuture, wait with a timeout) through Work::observe(): so a Python caller that waits at
//   once lets the group leave its worker asleep, as a C++ one does.
// - Errors cross into torch as c10::DistBackendError (torch.distributed.DistBackendError in
//   Python, a RuntimeError) carrying tdist's message, which names the rank, the operation, the
//   peer and the sequence number.
// - The callback holds `outputs` and `keep_alive` until the operations complete, so tensors stay
//   valid even if Python drops the Work of an async_op=True call.
// - The callback runs on tdist's progress thread; continuations chained with then() on the
//   future run there too (as on Gloo's worker threads), so they must not block on later
//   collectives of the same group.
//
// Thread safety: every method may be called from any thread.

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "tdist/comm/work.h"

namespace tdist::c10d_backend {

// Turns an error from tdist into the exception torch expects from a backend: c10 errors pass
// unchanged; anything else becomes c10::DistBackendError with the same message.
std::exception_ptr to_c10_error(std::exception_ptr error);

class WorkAdapter : public ::c10d::Work {
 public:
  // `works`: tdist operations issued in this order on one group (may be empty: then the Work is
  // complete at once). `outputs`: what getFuture() and result() give. `keep_alive`: tensors the
  // operations read, held until they complete. `source_rank`: for RECV, the source asked for.
  WorkAdapter(int rank, ::c10d::OpType op_type, std::vector<std::shared_ptr<comm::Work>> works,
              std::vector<at::Tensor> outputs, std::vector<at::Tensor> keep_alive = {},
              int source_rank = -1);
  ~WorkAdapter() override;

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override {}
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override;

 private:
  // "ALLREDUCE (allreduce, seq 7)": the c10d op and the tdist operation(s) behind it.
  std::string describe() const;
  // Tells each operation's group that the operation is looked at (Work::observe).
  void observe() const;

  // Constant after construction.
  const std::vector<std::shared_ptr<comm::Work>> works_;
  const std::vector<at::Tensor> outputs_;
  const int source_rank_;
  // Completes when every work has: works_[0]'s future, or a joint one.
  std::shared_ptr<comm::Future> done_;
  const c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace tdist::c10d_backend
