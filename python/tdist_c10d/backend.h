#pragma once
// TdistBackend: tdist as a c10d backend. torch.distributed's ProcessGroup dispatches CPU tensors
// to it; it forwards every operation of the c10d table to a tdist::comm::ProcessGroup and returns
// WorkAdapters (work.h).
//
// Created by create() from the options init_process_group / new_group pass to a registered
// backend (module.cpp): the c10d store (a PrefixStore per group and device) is adapted
// (store_adapter.h) and tdist's group rendezvouses through it, bounded by the timeout.
//
// Operations and their c10d names: broadcast, allreduce, allreduce_coalesced, reduce, allgather,
// _allgather_base, allgather_coalesced, allgather_into_tensor_coalesced, gather, scatter,
// reduce_scatter, _reduce_scatter_base, reduce_scatter_tensor_coalesced, alltoall_base (equal or
// split sizes), alltoall, barrier, send, recv, recvAnysource; startCoalescing/endCoalescing
// (operations between them are issued at once, in order, and endCoalescing's Work completes when
// all of them have); monitoredBarrier; allreduce of sparse COO tensors (SUM). Not supported (a
// RuntimeError that names the operation): allreduce_sparse (the sparseIndices form), splitting, ReduceOp.PREMUL_SUM, tensors that are not on the CPU, several
// tensors per rank in one call.
//
// Timeouts: an operation's timeout is its options' when set, else the backend's (the group's
// timeout from init_process_group, changeable with setTimeout).
//
// Thread safety: operations may be issued from several threads; as in c10d, the order in which
// they are issued must match across ranks. Ownership: owns its tdist group; destroying the
// backend destroys the group (never hangs, see comm/process_group.h).

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tdist/comm/process_group.h"

namespace tdist::c10d_backend {

inline constexpr const char* kBackendName = "tdist";
// The send/recv tag monitoredBarrier uses (user tags below it are free).
inline constexpr int kMonitoredBarrierTag = 0x7fffff00;

class TdistBackend final : public ::c10d::Backend {
 public:
  // Rendezvous through `opts.store` and connect; blocks up to opts.timeout. The caller must not
  // hold the GIL (the store may be implemented in Python).
  static c10::intrusive_ptr<::c10d::Backend> create(const ::c10d::DistributedBackendOptions& opts);

  TdistBackend(std::shared_ptr<comm::ProcessGroup> pg, c10::intrusive_ptr<Options> options);
  ~TdistBackend() override;

  const std::string getBackendName() const override { return kBackendName; }
  c10::intrusive_ptr<Options> getBackendOptions() override { return options_; }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return issued_.load(); }
  void abort() override;
  void shutdown() override;
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override;
  c10::intrusive_ptr<::c10d::Work> endCoalescing() override;

  c10::intrusive_ptr<::c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                             const ::c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                             const ::c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const ::c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                          const ::c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                             std::vector<at::Tensor>& inputs,
                                             const ::c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                   const ::c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const ::c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const ::c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const ::c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                           std::vector<std::vector<at::Tensor>>& inputs,
                                           const ::c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const ::c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const ::c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const ::c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                                 std::vector<int64_t>& output_splits,
                                                 std::vector<int64_t>& input_splits,
                                                 const ::c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                            std::vector<at::Tensor>& inputs,
                                            const ::c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> barrier(const ::c10d::BarrierOptions& opts) override;
  // Gloo's monitored barrier: every rank reports to rank 0 over send/recv (tag
  // kMonitoredBarrierTag), rank 0 names the first rank (or, with wait_all_ranks, every rank) that
  // did not arrive within the timeout, then releases the others. Blocks the caller.
  void monitoredBarrier(const ::c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  c10::intrusive_ptr<::c10d::Work> send(std::vector<at::Tensor>& tensors, int dst,
                                        int tag) override;
  c10::intrusive_ptr<::c10d::Work> recv(std::vector<at::Tensor>& tensors, int src,
                                        int tag) override;
  c10::intrusive_ptr<::c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                                 int tag) override;

  // The tdist group; throws a c10 error naming `op` after shutdown().
  std::shared_ptr<comm::ProcessGroup> group(const char* op = "group") const;

 private:
  // The timeout an operation runs under: `requested` when set (>= 0), else the backend's.
  comm::Millis timeout(std::chrono::milliseconds requested) const;
  c10::intrusive_ptr<::c10d::Work> make_work(::c10d::OpType type,
                                             std::vector<std::shared_ptr<comm::Work>> works,
                                             std::vector<at::Tensor> outputs,
                                             std::vector<at::Tensor> keep_alive = {},
                                             int source_rank = -1);

  // Constant after construction.
  const c10::intrusive_ptr<Options> options_;
  mutable std::mutex mu_;
  // Released by shutdown(); guarded by mu_ (operations copy it, then issue without the lock).
  std::shared_ptr<comm::ProcessGroup> pg_;
  // Between startCoalescing and endCoalescing: the operations issued so far. Guarded by mu_.
  bool coalescing_ = false;
  std::vector<std::shared_ptr<comm::Work>> coalesced_works_;
  std::vector<at::Tensor> coalesced_outputs_;
  // Changed by setTimeout; read by every operation.
  std::atomic<int64_t> timeout_ms_;
  // Operations issued through this backend (c10d's sequence number for the group).
  std::atomic<uint64_t> issued_{0};
};

}  // namespace tdist::c10d_backend
