#pragma once
// NcclProcessGroup: tdist's ProcessGroup for CUDA tensors, built on PyTorch's own
// c10d::ProcessGroupNCCL (from libtorch_cuda), so its watchdog, stream semantics, communicator
// abort and caching-allocator safety are the ones PyTorch users already trust. Lives in its own
// library (libtdist_comm_nccl.so), which create_process_group loads when a backend string names
// "cuda:nccl" (Note [Device dispatch] in comm/device_dispatch.h), so programs without GPUs
// never load libtorch_cuda.
//
// Note [NCCL works]
// ~~~~~~~~~~~~~~~~~
// - Issuing an operation enqueues it on ProcessGroupNCCL's NCCL stream (after the caller's
//   current stream, as c10d does) and returns at once.
// - Work::wait() is c10d's: the caller's current CUDA stream waits for the operation; the CPU
//   does not block. Work::synchronize() blocks the CPU until the device finished it.
// - Work::future() completes when the device finished the operation (not when it was enqueued):
//   a completion thread of the group polls each pending c10d work's isCompleted() (a CUDA event
//   query), so a continuation (DDP's buckets, comm hooks) may read the results on any stream.
// - A failure (NCCL's asynchronous errors, or the c10d watchdog's timeout, which aborts the
//   communicator) fails the future with an Error naming this rank, the operation and its
//   sequence number. By default PyTorch then also ends the process (TORCH_NCCL_ASYNC_ERROR_HANDLING,
//   its default 3); set it to 0 or 1 to keep the process and see the error instead.
// - abort() aborts the NCCL communicators and fails every pending Work.
//
// Note [Split communicators]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// With Options::device_id set the group is bound to that device (c10d's bound device id) and
// connects at once (eagerConnectSingleDevice). new_group then splits the subgroup's communicator
// from this group's, as c10d does for a group created with a device_id: ncclCommSplit reuses the
// parent's connections instead of a new bootstrap through the store. The split is collective
// over every rank of the parent, and all of them call new_group (ProcessGroup's contract): a
// member creates its subgroup with c10d's split_from and connects it, a non-member takes part
// with no colour (performNocolorSplit). Both sides decide from the same inputs (the parent's
// device_id and the subgroup's options, which every rank passes alike), so they never disagree
// about whether a split happens. Without device_id, or when the subgroup names another device,
// the subgroup gets its own communicator at its first operation, as before.
//
// Thread safety: as ProcessGroup's. Operations must be issued in the same order on every rank.

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/intrusive_ptr.h>

#include "tdist/comm/process_group.h"

namespace c10d {
class ProcessGroupNCCL;
class Work;
}  // namespace c10d

namespace tdist::comm::nccl {

class NcclProcessGroup : public ProcessGroup {
 public:
  // `store` is used under `prefix` only; opts.timeout becomes c10d's operation timeout.
  NcclProcessGroup(std::shared_ptr<Store> store, std::string prefix, int rank, int size,
                   const Options& opts);
  ~NcclProcessGroup() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override { return "nccl"; }
  const Options& options() const override { return opts_; }

  // Each operation goes to its start() (Note [One operation table] in comm/calls.h).
  std::shared_ptr<Work> submit(Call call) override;
  std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks, const Options& opts) override;
  void abort() override;

  // How many communicators were split from this group's (Note [Split communicators]).
  uint64_t comm_split_count() const;

 private:
  // The operations, one function each: they check the arguments on the caller's thread and
  // return the operation's Work at once. One specialization per Call, in
  // nccl_process_group.cpp; one missing fails the link.
  template <class C>
  std::shared_ptr<Work> start(C& call);

  struct SplitFrom;  // the parent of a split subgroup (nccl_process_group.cpp)
  NcclProcessGroup(std::shared_ptr<Store> store, std::string prefix, int rank, int size,
                   const Options& opts, const SplitFrom* split);

  struct Pending {
    std::string op;
    uint64_t seq;
    c10::intrusive_ptr<::c10d::Work> work;
    std::vector<at::Tensor> outputs;
    std::shared_ptr<Future> future;
  };
  // Wraps the c10d work of operation `op` (checks and c10d's own exceptions become tdist errors
  // naming the rank, the operation and the sequence number) and hands it to the completion thread.
  std::shared_ptr<Work> issue(const std::string& op, std::vector<at::Tensor> outputs,
                              const std::function<c10::intrusive_ptr<::c10d::Work>()>& call);
  std::chrono::milliseconds timeout_of(Millis t) const;
  void complete_loop();

  // Constant after construction.
  const std::shared_ptr<Store> store_;
  const std::string prefix_;
  const int rank_;
  const int size_;
  const Options opts_;
  c10::intrusive_ptr<::c10d::ProcessGroupNCCL> pg_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;  // guarded by mu_
  uint64_t next_seq_ = 0;        // guarded by mu_
  uint64_t subgroups_ = 0;       // guarded by mu_
  bool stopping_ = false;        // guarded by mu_
  std::thread completer_;
};

}  // namespace tdist::comm::nccl
