#include "tdist/optim/optimizer_spec.h"

#include <torch/optim.h>

#include "tdist/core/error.h"

namespace tdist::optim {

OptimizerSpec OptimizerSpec::sgd(const torch::optim::SGDOptions& o) {
  OptimizerSpec s;
  s.kind = kSGD;
  s.lr = o.lr();
  s.momentum = o.momentum();
  s.dampening = o.dampening();
  s.weight_decay = o.weight_decay();
  s.nesterov = o.nesterov();
  return s;
}

namespace {

// Adam and AdamW share their options' fields.
template <class Options>
OptimizerSpec adam_family(OptimizerSpec::Kind kind, const Options& o) {
  OptimizerSpec s;
  s.kind = kind;
  s.lr = o.lr();
  s.beta1 = std::get<0>(o.betas());
  s.beta2 = std::get<1>(o.betas());
  s.eps = o.eps();
  s.weight_decay = o.weight_decay();
  s.amsgrad = o.amsgrad();
  return s;
}

}  // namespace

OptimizerSpec OptimizerSpec::adam(const torch::optim::AdamOptions& o) {
  return adam_family(kAdam, o);
}

OptimizerSpec OptimizerSpec::adamw(const torch::optim::AdamWOptions& o) {
  return adam_family(kAdamW, o);
}

OptimizerSpec OptimizerSpec::rmsprop(const torch::optim::RMSpropOptions& o) {
  OptimizerSpec s;
  s.kind = kRMSprop;
  s.lr = o.lr();
  s.alpha = o.alpha();
  s.eps = o.eps();
  s.weight_decay = o.weight_decay();
  s.momentum = o.momentum();
  s.centered = o.centered();
  return s;
}

OptimizerSpec OptimizerSpec::adagrad(const torch::optim::AdagradOptions& o) {
  OptimizerSpec s;
  s.kind = kAdagrad;
  s.lr = o.lr();
  s.lr_decay = o.lr_decay();
  s.weight_decay = o.weight_decay();
  s.initial_accumulator_value = o.initial_accumulator_value();
  s.eps = o.eps();
  return s;
}

std::string OptimizerSpec::name() const {
  switch (kind) {
    case kSGD:
      return "SGD";
    case kAdam:
      return "Adam";
    case kAdamW:
      return "AdamW";
    case kRMSprop:
      return "RMSprop";
    case kAdagrad:
      return "Adagrad";
  }
  return "unknown optimizer " + std::to_string(kind);
}

std::unique_ptr<torch::optim::Optimizer> OptimizerSpec::build(
    std::vector<at::Tensor> params) const {
  namespace o = torch::optim;
  switch (kind) {
    case kSGD:
      return std::make_unique<o::SGD>(params, o::SGDOptions(lr)
                                                  .momentum(momentum)
                                                  .dampening(dampening)
                                                  .weight_decay(weight_decay)
                                                  .nesterov(nesterov));
    case kAdam:
      return std::make_unique<o::Adam>(params, o::AdamOptions(lr)
                                                   .betas(std::make_tuple(beta1, beta2))
                                                   .eps(eps)
                                                   .weight_decay(weight_decay)
                                                   .amsgrad(amsgrad));
    case kAdamW:
      return std::make_unique<o::AdamW>(params, o::AdamWOptions(lr)
                                                    .betas(std::make_tuple(beta1, beta2))
                                                    .eps(eps)
                                                    .weight_decay(weight_decay)
                                                    .amsgrad(amsgrad));
    case kRMSprop:
      return std::make_unique<o::RMSprop>(params, o::RMSpropOptions(lr)
                                                      .alpha(alpha)
                                                      .eps(eps)
                                                      .weight_decay(weight_decay)
                                                      .momentum(momentum)
                                                      .centered(centered));
    case kAdagrad:
      return std::make_unique<o::Adagrad>(params,
                                          o::AdagradOptions(lr)
                                              .lr_decay(lr_decay)
                                              .weight_decay(weight_decay)
                                              .initial_accumulator_value(initial_accumulator_value)
                                              .eps(eps));
  }
  throw InvalidArgument(str("unknown optimizer kind ", kind));
}

}  // namespace tdist::optim
