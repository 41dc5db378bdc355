#pragma once
// Note [Device dispatch]
// ~~~~~~~~~~~~~~~~~~~~~~
// A backend string names a backend per device type: "ring" serves every device (CUDA tensors
// staged through host memory, Note [Staging device tensors]); "cpu:ring,cuda:nccl" sends the
// operations on CUDA tensors to NCCL and the rest to the ring. The NCCL backend lives in its own
// library, libtdist_comm_nccl.so (built when the CUDA toolkit and NCCL are found), which
// create_process_group loads (dlopen, next to libtdist_comm.so, else by the loader's search
// path) only when a backend string names it, so programs that never ask for NCCL never load
// libtorch_cuda. Both backends of a group are created together, on every rank, under the
// group's store prefix. DispatchProcessGroup routes each operation by its tensors' device: all
// CUDA goes to the CUDA backend, anything else to the CPU backend; an operation mixing CUDA and
// CPU tensors is refused (InvalidArgument). barrier() runs on the CPU backend (it orders the
// ranks' CPUs; a CUDA Work's wait orders the streams). Each backend keeps its own order, so the
// rule that every rank issues the operations of a group in one order holds per backend.

#include <memory>
#include <string>

#include "tdist/comm/nccl/entry_point.h"
#include "tdist/comm/process_group.h"

namespace tdist::comm::detail {

using nccl::BackendFactory;

// The NCCL backend's factory from libtdist_comm_nccl.so; throws InvalidArgument saying why when
// the library is missing or cannot be loaded (no CUDA build, no libtorch_cuda).
BackendFactory load_nccl_backend();

class DispatchProcessGroup : public ProcessGroup {
 public:
  DispatchProcessGroup(std::shared_ptr<ProcessGroup> cpu, std::shared_ptr<ProcessGroup> cuda,
                       Options opts);

  int rank() const override { return cpu_->rank(); }
  int size() const override { return cpu_->size(); }
  std::string backend_name() const override;
  const Options& options() const override { return opts_; }

  // Routes any operation (Note [One operation table] in comm/calls.h).
  std::shared_ptr<Work> submit(Call call) override;
  std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks, const Options& opts) override;
  void abort() override;
  // The CPU group's (symmetric memory is host memory).
  at::Tensor symmetric_empty(const std::vector<int64_t>& sizes, at::ScalarType dtype) override {
    return cpu_->symmetric_empty(sizes, dtype);
  }
  bool is_symmetric(const at::Tensor& t) const override { return cpu_->is_symmetric(t); }

 private:
  // The backend for `call` (Note [Device dispatch]).
  ProcessGroup& route(const Call& call);

  // Constant after construction.
  const std::shared_ptr<ProcessGroup> cpu_;
  const std::shared_ptr<ProcessGroup> cuda_;
  const Options opts_;
};

}  // namespace tdist::comm::detail
