#pragma once
// The optimizer DistributedOptimizer creates on each owner (registered as the RPC class
// "tdist.optim.LocalOptimizer"): a libtorch optimizer over the owner's parameters.
// Thread safety: step, state and load_state of every LocalOptimizer of a process are serialized
// by one process-wide mutex (steps of several trainers on one owner apply one after another,
// as torch's _LocalOptimizer does).

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "tdist/optim/optimizer_spec.h"
#include "tdist/rpc/rref.h"

namespace tdist::optim::detail {

inline constexpr const char* kLocalOptimizerClass = "tdist.optim.LocalOptimizer";

class LocalOptimizer {
 public:
  LocalOptimizer() = default;  // (RPC argument decoding needs it; unused)
  // `params` are RRefs owned here.
  LocalOptimizer(OptimizerSpec spec, std::vector<rpc::RRef<at::Tensor>> params);
  ~LocalOptimizer();
  LocalOptimizer(LocalOptimizer&&) noexcept;
  LocalOptimizer& operator=(LocalOptimizer&&) noexcept;

  // Applies the gradients of distributed autograd context `context_id` held on this worker.
  void step(int64_t context_id);
  int64_t num_params() const { return static_cast<int64_t>(params_.size()); }
  // The optimizer's state (torch::save) and its reverse.
  std::string state() const;
  void load_state(const std::string& bytes);

 private:
  std::vector<at::Tensor> params_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
};

// Registers the class (idempotent; also done when the library loads).
void register_local_optimizer();

}  // namespace tdist::optim::detail
