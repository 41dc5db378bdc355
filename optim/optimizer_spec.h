#pragma once
// OptimizerSpec: which libtorch optimizer DistributedOptimizer builds on each owner, with its
// options. Made from libtorch's own option types:
//
//   auto spec = tdist::optim::OptimizerSpec::sgd(torch::optim::SGDOptions(0.05).momentum(0.9));
//   auto spec = tdist::optim::OptimizerSpec::adam(torch::optim::AdamOptions(1e-3));
//
// A plain value (sent to the owners with the RPC archive); build() makes the optimizer.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
struct SGDOptions;
struct AdamOptions;
struct AdamWOptions;
struct RMSpropOptions;
struct AdagradOptions;
}  // namespace torch::optim

namespace tdist::optim {

struct OptimizerSpec {
  enum Kind : int32_t { kSGD = 0, kAdam, kAdamW, kRMSprop, kAdagrad };

  static OptimizerSpec sgd(const torch::optim::SGDOptions& o);
  static OptimizerSpec adam(const torch::optim::AdamOptions& o);
  static OptimizerSpec adamw(const torch::optim::AdamWOptions& o);
  static OptimizerSpec rmsprop(const torch::optim::RMSpropOptions& o);
  static OptimizerSpec adagrad(const torch::optim::AdagradOptions& o);

  // A new optimizer of this kind over `params`; InvalidArgument for an unknown kind.
  std::unique_ptr<torch::optim::Optimizer> build(std::vector<at::Tensor> params) const;
  std::string name() const;  // "SGD", "Adam", ...

  int32_t kind = kSGD;
  // The union of the options of the five kinds; each kind reads its own.
  double lr = 0.01;
  double momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  bool amsgrad = false;
  double alpha = 0.99;
  bool centered = false;
  double lr_decay = 0, initial_accumulator_value = 0;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(kind, lr, momentum, dampening, weight_decay, nesterov, beta1, beta2, eps, amsgrad, alpha,
       centered, lr_decay, initial_accumulator_value);
  }
};

}  // namespace tdist::optim
