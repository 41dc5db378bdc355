#pragma once
// DistributedDataParallel: data-parallel training of a torch::nn::Module across the ranks of a
// process group (PyTorch's torch.nn.parallel.DistributedDataParallel, in C++).
//
//   auto pg = tdist::comm::create_process_group("env://");
//   Net net;                                           // a TORCH_MODULE holder or shared_ptr
//   tdist::ddp::DistributedDataParallel<Net> model(net, pg);
//   torch::optim::SGD opt(model.parameters(), 0.1);    // an unchanged optimizer
//   for (...) {
//     opt.zero_grad();
//     auto loss = torch::mse_loss(model(x), y);        // forward's arguments and result as Net's
//     loss.backward();                                 // gradients averaged across ranks here
//     opt.step();
//   }
//
// Construction (a collective): checks that every rank has the same parameters and buffers
// (names, dtypes, shapes; a mismatch names them and the ranks), broadcasts them from rank 0 and
// registers the gradient hooks (see Note [DDP bucketing] in reducer.h). Each forward that will
// sync (grad mode on, no no_sync guard alive) first broadcasts buffers from rank 0
// (broadcast_buffers), and the backward of its result averages the gradients across ranks,
// overlapping the allreduce of each bucket with the rest of backward.
//
// Every rank must run the same sequence of synchronizing forwards and backwards.
// Thread safety: one thread drives a DDP object (as with a module); blocking: construction,
// forward (buffer broadcast, bucket rebuild) and backward's end wait for the other ranks, each
// bounded by the options' timeout (the group's by default).

#include <ATen/core/Tensor.h>

#include <memory>
#include <utility>
#include <vector>

#include "tdist/ddp/comm_hooks.h"
#include "tdist/ddp/detail/ddp_core.h"
#include "tdist/ddp/options.h"

namespace tdist::comm {
class ProcessGroup;
}

namespace tdist::ddp {

// While alive, forwards of `ddp` do not synchronize: gradients accumulate locally in .grad, and
// the first synchronizing backward after it averages the accumulated sum (PyTorch's no_sync()).
class NoSyncGuard {
 public:
  explicit NoSyncGuard(detail::DDPCore& core) : core_(&core), previous_(core.require_sync()) {
    core_->set_require_sync(false);
  }
  ~NoSyncGuard() {
    if (core_) core_->set_require_sync(previous_);
  }
  NoSyncGuard(NoSyncGuard&& o) noexcept : core_(o.core_), previous_(o.previous_) {
    o.core_ = nullptr;
  }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;

 private:
  detail::DDPCore* core_;
  bool previous_;
};

// ModuleType: a module holder (TORCH_MODULE(Net), torch::nn::Sequential, ...) or a
// std::shared_ptr to a torch::nn::Module subclass. See the file comment.
template <typename ModuleType>
class DistributedDataParallel {
 public:
  DistributedDataParallel(ModuleType module, std::shared_ptr<comm::ProcessGroup> pg,
                          DDPOptions opts = {})
      : module_(std::move(module)),
        core_(std::make_unique<detail::DDPCore>(module_ptr(module_), std::move(pg), opts)) {}

  // Calls module->forward(args...) and returns its result (see the class comment).
  template <typename... Args>
  auto forward(Args&&... args) {
    const bool sync = core_->pre_forward();
    auto out = module_->forward(std::forward<Args>(args)...);
    std::vector<at::Tensor> tensors;
    bool known = false;
    if (sync) known = detail::CollectTensors<std::decay_t<decltype(out)>>::run(out, tensors);
    core_->post_forward(sync, tensors, known);
    return out;
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  ModuleType& module() { return module_; }
  const ModuleType& module() const { return module_; }
  // The wrapped module's parameters (the same tensors): give these to the optimizer.
  std::vector<at::Tensor> parameters(bool recurse = true) const {
    return module_->parameters(recurse);
  }
  auto named_parameters(bool recurse = true) const { return module_->named_parameters(recurse); }
  auto buffers(bool recurse = true) const { return module_->buffers(recurse); }
  void train(bool on = true) { module_->train(on); }
  void eval() { module_->eval(); }

  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*core_); }

  // Between iterations only; see comm_hooks.h.
  void register_comm_hook(CommHook hook);
  Reducer& reducer() { return core_->reducer(); }
  const std::shared_ptr<comm::ProcessGroup>& process_group() const {
    return core_->process_group();
  }
  const DDPOptions& options() const { return core_->options(); }

 private:
  static std::shared_ptr<torch::nn::Module> module_ptr(const ModuleType& m) {
    if constexpr (detail::IsSharedPtr<ModuleType>::value) {
      return m;
    } else {
      return m.ptr();
    }
  }

  ModuleType module_;
  std::unique_ptr<detail::DDPCore> core_;
};

void register_comm_hook(detail::DDPCore& core, CommHook hook);

template <typename ModuleType>
void DistributedDataParallel<ModuleType>::register_comm_hook(CommHook hook) {
  ::tdist::ddp::register_comm_hook(*core_, std::move(hook));
}

}  // namespace tdist::ddp
