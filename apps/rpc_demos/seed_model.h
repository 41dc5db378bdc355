#pragma once
// The seed example's model and data (tdist-rpc-seed), shared with its test, which trains the same
// model on the same data in one process with plain libtorch and compares the weights.

#include <torch/torch.h>

#include <vector>

namespace tdist::demo::seed {

constexpr int64_t kDefaultSteps = 40;
constexpr double kDefaultLr = 0.05;

// Node A's 8 samples: y = 1.5 * x0 - 0.5 * x1 + 0.25 (noise-free, no bias in the model).
inline at::Tensor inputs() {
  return torch::tensor({{1.0f, 2.0f},
                        {2.0f, 1.0f},
                        {-1.0f, 0.5f},
                        {0.5f, -1.5f},
                        {3.0f, 0.0f},
                        {0.0f, -2.0f},
                        {-2.0f, -1.0f},
                        {1.5f, 1.5f}});
}
inline at::Tensor targets() {
  at::Tensor x = inputs();
  return (1.5f * x.select(1, 0) - 0.5f * x.select(1, 1) + 0.25f).unsqueeze(1);
}
// The layer's starting weight (1 x 2).
inline std::vector<double> initial_weight() { return {0.3, -0.2}; }

// One linear layer, 2 -> 1, no bias.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(const std::vector<double>& w) {
    fc = register_module("fc", torch::nn::Linear(torch::nn::LinearOptions(2, 1).bias(false)));
    torch::NoGradGuard no_grad;
    fc->weight.copy_(torch::tensor(std::vector<float>(w.begin(), w.end())).view({1, 2}));
  }
  at::Tensor forward(const at::Tensor& x) { return fc->forward(x); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Net);

// Single-process libtorch training of the same model on the same data: the reference.
inline at::Tensor train_locally(int64_t steps, double lr) {
  Net net(initial_weight());
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(lr));
  for (int64_t s = 0; s < steps; ++s) {
    opt.zero_grad();
    torch::mse_loss(net->forward(inputs()), targets()).backward();
    opt.step();
  }
  return net->fc->weight.detach().clone();
}

}  // namespace tdist::demo::seed
