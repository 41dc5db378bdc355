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

ProcessGroup& DispatchProcessGroup::route(const Call& call) {
  // barrier() orders the ranks' CPUs (Note [Device dispatch]).
  if (std::holds_alternative<BarrierCall>(call)) return *cpu_;
  int cuda = 0, other = 0;
  for_each_tensor(call, [&](const at::Tensor& t) {
    if (t.defined()) (t.is_cuda() ? cuda : other)++;  // an undefined one: the backend names it
  });
  TDIST_CHECK_ARG(cuda == 0 || other == 0, call_name(call), ": ", cuda, " CUDA and ", other,
                  " other tensors "
                  "in one operation; the backends are chosen per device type ('",
                  backend_name(), "'), so all tensors of an operation must be on one");
  return cuda > 0 ? *cuda_ : *cpu_;
}

std::shared_ptr<Work> DispatchProcessGroup::submit(Call call) {
  return route(call).submit(std::move(call));
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
