#include "tdist/optim/detail/local_optimizer.h"

#include <torch/optim.h>
#include <torch/serialize.h>

#include <mutex>
#include <sstream>

#include "tdist/autograd/context.h"
#include "tdist/rpc/api.h"

namespace tdist::optim::detail {
namespace {
// Serializes every LocalOptimizer's updates in this process (see the header).
std::mutex g_step_mu;
}  // namespace

LocalOptimizer::LocalOptimizer(OptimizerSpec spec, std::vector<rpc::RRef<at::Tensor>> params) {
  for (const auto& r : params) {
    TDIST_CHECK_ARG(r.is_owner(), "LocalOptimizer: parameter RRef ", r.id().str(),
                    " is owned by worker rank ", r.owner(), ", not here");
    at::Tensor p = *r.local_value();
    TDIST_CHECK_ARG(p.defined() && p.is_leaf() && p.requires_grad(), "LocalOptimizer: parameter ",
                    r.id().str(), " is not a leaf tensor that requires grad");
    params_.push_back(p);
  }
  optimizer_ = spec.build(params_);
}

LocalOptimizer::~LocalOptimizer() = default;
LocalOptimizer::LocalOptimizer(LocalOptimizer&&) noexcept = default;
LocalOptimizer& LocalOptimizer::operator=(LocalOptimizer&&) noexcept = default;

void LocalOptimizer::step(int64_t context_id) {
  autograd::GradientMap grads = autograd::get_gradients(context_id);
  std::lock_guard<std::mutex> lock(g_step_mu);
  // The optimizer reads .grad: set it from the context for this step only.
  for (auto& p : params_) {
    auto it = grads.find(p);
    p.mutable_grad() = it == grads.end() ? at::Tensor() : it->second;
  }
  try {
    optimizer_->step();
  } catch (...) {
    for (auto& p : params_) p.mutable_grad() = at::Tensor();
    throw;
  }
  for (auto& p : params_) p.mutable_grad() = at::Tensor();
}

std::string LocalOptimizer::state() const {
  std::lock_guard<std::mutex> lock(g_step_mu);
  std::ostringstream os;
  torch::save(*optimizer_, os);
  return os.str();
}

void LocalOptimizer::load_state(const std::string& bytes) {
  std::lock_guard<std::mutex> lock(g_step_mu);
  std::istringstream is(bytes);
  torch::load(*optimizer_, is);
}

void register_local_optimizer() {
  static std::once_flag once;
  std::call_once(once, [] {
    autograd::init();
    rpc::register_class<LocalOptimizer>(kLocalOptimizerClass)
        .constructor<OptimizerSpec, std::vector<rpc::RRef<at::Tensor>>>()
        .method("step", &LocalOptimizer::step)
        .method("num_params", &LocalOptimizer::num_params)
        .method("state", &LocalOptimizer::state)
        .method("load_state", &LocalOptimizer::load_state);
  });
}

namespace {
[[maybe_unused]] const bool g_registered = (register_local_optimizer(), true);
}  // namespace

}  // namespace tdist::optim::detail
