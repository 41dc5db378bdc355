#include "tdist/ddp/distributed_data_parallel.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/ddp/model_sync.h"
#include "tdist/ddp/reducer.h"
#include "tdist/ddp/trace.h"

namespace tdist::ddp {
namespace detail {

DDPCore::DDPCore(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<comm::ProcessGroup> pg,
                 DDPOptions opts)
    : module_(std::move(module)), pg_(std::move(pg)), opts_(opts) {
  TDIST_CHECK_ARG(module_ != nullptr, "DDP needs a module");
  TDIST_CHECK_ARG(pg_ != nullptr, "DDP needs a process group");

  std::vector<TensorSignature> sigs;
  std::vector<at::Tensor> state;  // parameters and buffers, broadcast from rank 0
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    sigs.push_back(signature_of("parameter", item.key(), item.value()));
    state.push_back(item.value());
    if (item.value().requires_grad()) {
      params.push_back(item.value());
      names.push_back(item.key());
    }
  }
  for (const auto& item : module_->named_buffers(/*recurse=*/true)) {
    sigs.push_back(signature_of("buffer", item.key(), item.value()));
    state.push_back(item.value());
  }
  verify_same_across_ranks(*pg_, sigs, timeout());
  broadcast_coalesced(*pg_, state, /*root=*/0, timeout());
  trace_ = Trace::from_env(pg_->rank());
  reducer_ = std::make_unique<Reducer>(std::move(params), std::move(names), pg_, opts_, trace_);
  TDIST_LOG_DEBUG("DDP: ", reducer_->num_buckets(), " buckets over ", sigs.size(),
                  " parameters and buffers");
}

DDPCore::~DDPCore() = default;

std::chrono::milliseconds DDPCore::timeout() const {
  return opts_.timeout.count() >= 0 ? opts_.timeout : pg_->options().timeout;
}

bool DDPCore::pre_forward() {
  forward_begin_us_ = Trace::now_us();
  const bool sync = require_sync_ && c10::GradMode::is_enabled();
  if (!sync) return false;
  reducer_->prepare_for_forward();
  if (opts_.broadcast_buffers && pg_->size() > 1) {
    std::vector<at::Tensor> buffers = module_->buffers(/*recurse=*/true);
    if (!buffers.empty()) broadcast_coalesced(*pg_, buffers, /*root=*/0, timeout());
  }
  return true;
}

void DDPCore::post_forward(bool sync, const std::vector<at::Tensor>& outputs, bool outputs_known) {
  if (sync) reducer_->prepare_for_backward(outputs, outputs_known);
  if (trace_) {
    trace_->add(sync ? "forward" : "forward (no sync)", Trace::Track::kCompute, forward_begin_us_,
                Trace::now_us());
  }
}

}  // namespace detail

void register_comm_hook(detail::DDPCore& core, CommHook hook) {
  core.reducer().register_comm_hook(std::move(hook));
}

}  // namespace tdist::ddp
