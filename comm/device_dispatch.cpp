#include "tdist/comm/device_dispatch.h"

#include <dlfcn.h>

#include "tdist/core/error.h"

namespace tdist::comm::detail {

BackendFactory load_nccl_backend() {
  static const auto loaded = []() -> std::pair<BackendFactory, std::string> {
    const char* kName = "libtdist_comm_nccl.so";
    std::string tried;
    void* handle = nullptr;
    Dl_info self{};
    if (::dladdr(reinterpret_cast<void*>(&load_nccl_backend), &self) != 0 && self.dli_fname) {
      std::string dir = self.dli_fname;
      dir = dir.substr(0, dir.find_last_of('/') + 1);
      handle = ::dlopen((dir + kName).c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!handle) tried = ::dlerror();
    }
    if (!handle) handle = ::dlopen(kName, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      const char* e = ::dlerror();
      return {nullptr, str(tried.empty() ? "" : tried + "; ", e ? e : "not found")};
    }
    using Entry = BackendFactory (*)();
    auto entry = reinterpret_cast<Entry>(::dlsym(handle, nccl::kFactorySymbol));
    if (!entry) return {nullptr, str(kName, " has no ", nccl::kFactorySymbol)};
    return {entry(), ""};
  }();
  TDIST_CHECK_ARG(loaded.first != nullptr,
                  "the nccl backend is not available: this build of "
                  "tdist has no NCCL backend, or it cannot be loaded (",
                  loaded.second, ")");
  return loaded.first;
}

DispatchProcessGroup::DispatchProcessGroup(std::shared_ptr<ProcessGroup> cpu,
                                           std::shared_ptr<ProcessGroup> cuda, Options opts)
    : cpu_(std::move(cpu)), cuda_(std::move(cuda)), opts_(std::move(opts)) {}

std::string DispatchProcessGroup::backend_name() const {
  return str("cpu:", cpu_->backend_name(), ",cuda:", cuda_->backend_name());
}

ProcessGroup& DispatchProcessGroup::route(
    const char* op, std::initializer_list<const std::vector<at::Tensor>*> tensors) {
  int cuda = 0, other = 0;
  for (const auto* list : tensors) {
    for (const auto& t : *list) {
      if (!t.defined()) continue;  // the backend names it
      (t.is_cuda() ? cuda : other)++;
    }
  }
  TDIST_CHECK_ARG(cuda == 0 || other == 0, op, ": ", cuda, " CUDA and ", other,
                  " other tensors "
                  "in one operation; the backends are chosen per device type ('",
                  backend_name(), "'), so all tensors of an operation must be on one");
  return cuda > 0 ? *cuda_ : *cpu_;
}

std::shared_ptr<Work> DispatchProcessGroup::broadcast(at::Tensor tensor,
                                                      const BroadcastOptions& opts) {
  std::vector<at::Tensor> ts{tensor};
  return route("broadcast", {&ts}).broadcast(std::move(tensor), opts);
}

std::shared_ptr<Work> DispatchProcessGroup::allreduce(at::Tensor tensor,
                                                      const AllreduceOptions& opts) {
  std::vector<at::Tensor> ts{tensor};
  return route("allreduce", {&ts}).allreduce(std::move(tensor), opts);
}

std::shared_ptr<Work> DispatchProcessGroup::allreduce_coalesced(
    std::vector<at::Tensor> tensors, const AllreduceCoalescedOptions& opts) {
  return route("allreduce_coalesced", {&tensors}).allreduce_coalesced(std::move(tensors), opts);
}

std::shared_ptr<Work> DispatchProcessGroup::reduce(at::Tensor tensor, const ReduceOptions& opts) {
  std::vector<at::Tensor> ts{tensor};
  return route("reduce", {&ts}).reduce(std::move(tensor), opts);
}

std::shared_ptr<Work> DispatchProcessGroup::allgather(std::vector<at::Tensor> outputs,
                                                      at::Tensor input,
                                                      const AllgatherOptions& opts) {
  std::vector<at::Tensor> in{input};
  return route("allgather", {&outputs, &in}).allgather(std::move(outputs), std::move(input), opts);
}

std::shared_ptr<Work> DispatchProcessGroup::allgather_into_tensor(at::Tensor output,
                                                                  at::Tensor input,
                                                                  const AllgatherOptions& opts) {
  std::vector<at::Tensor> ts{output, input};
  return route("allgather_into_tensor", {&ts})
      .allgather_into_tensor(std::move(output), std::move(input), opts);
}

std::shared_ptr<Work> DispatchProcessGroup::gather(std::vector<at::Tensor> outputs,
                                                   at::Tensor input, const GatherOptions& opts) {
  std::vector<at::Tensor> in{input};
  return route("gather", {&outputs, &in}).gather(std::move(outputs), std::move(input), opts);
}

std::shared_ptr<Work> DispatchProcessGroup::scatter(at::Tensor output,
                                                    std::vector<at::Tensor> inputs,
                                                    const ScatterOptions& opts) {
  std::vector<at::Tensor> out{output};
  return route("scatter", {&out, &inputs}).scatter(std::move(output), std::move(inputs), opts);
}

std::shared_ptr<Work> DispatchProcessGroup::reduce_scatter(at::Tensor output,
                                                           std::vector<at::Tensor> inputs,
                                                           const ReduceScatterOptions& opts) {
  std::vector<at::Tensor> out{output};
  return route("reduce_scatter", {&out, &inputs})
      .reduce_scatter(std::move(output), std::move(inputs), opts);
}

std::shared_ptr<Work> DispatchProcessGroup::reduce_scatter_tensor(
    at::Tensor output, at::Tensor input, const ReduceScatterOptions& opts) {
  std::vector<at::Tensor> ts{output, input};
  return route("reduce_scatter_tensor", {&ts})
      .reduce_scatter_tensor(std::move(output), std::move(input), opts);
}

std::shared_ptr<Work> DispatchProcessGroup::alltoall_base(at::Tensor output, at::Tensor input,
                                                          std::vector<int64_t> output_splits,
                                                          std::vector<int64_t> input_splits,
                                                          const AllToAllOptions& opts) {
  std::vector<at::Tensor> ts{output, input};
  return route("alltoall_base", {&ts})
      .alltoall_base(std::move(output), std::move(input), std::move(output_splits),
                     std::move(input_splits), opts);
}

std::shared_ptr<Work> DispatchProcessGroup::alltoall(std::vector<at::Tensor> outputs,
                                                     std::vector<at::Tensor> inputs,
                                                     const AllToAllOptions& opts) {
  return route("alltoall", {&outputs, &inputs})
      .alltoall(std::move(outputs), std::move(inputs), opts);
}

std::shared_ptr<Work> DispatchProcessGroup::barrier(const BarrierOptions& opts) {
  return cpu_->barrier(opts);
}

std::shared_ptr<Work> DispatchProcessGroup::send(at::Tensor tensor, int dst, int tag,
                                                 const SendRecvOptions& opts) {
  std::vector<at::Tensor> ts{tensor};
  return route("send", {&ts}).send(std::move(tensor), dst, tag, opts);
}

std::shared_ptr<Work> DispatchProcessGroup::recv(at::Tensor tensor, int src, int tag,
                                                 const SendRecvOptions& opts) {
  std::vector<at::Tensor> ts{tensor};
  return route("recv", {&ts}).recv(std::move(tensor), src, tag, opts);
}

std::shared_ptr<Work> DispatchProcessGroup::recv_any_source(at::Tensor tensor, int tag,
                                                            const SendRecvOptions& opts) {
  std::vector<at::Tensor> ts{tensor};
  return route("recv_any_source", {&ts}).recv_any_source(std::move(tensor), tag, opts);
}

std::shared_ptr<ProcessGroup> DispatchProcessGroup::new_group(std::vector<int> ranks,
                                                              const Options& opts) {
  // Both backends count their subgroups; every rank calls this, members or not.
  auto cpu = cpu_->new_group(ranks, opts);
  auto cuda = cuda_->new_group(ranks, opts);
  if (!cpu) return nullptr;
  return std::make_shared<DispatchProcessGroup>(std::move(cpu), std::move(cuda), opts);
}

void DispatchProcessGroup::abort() {
  cpu_->abort();
  cuda_->abort();
}

}  // namespace tdist::comm::detail
