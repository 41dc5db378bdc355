// Zero-bubble's split of a layer's backward (pipeline/detail/split_backward.h), in one process:
// I (autograd::grad into the layer's input) and then W from the forks must give the input and
// every parameter the gradients of one whole backward, on layers whose parameters leave the
// input's path in different ways; where W from the forks would count a gradient twice, the
// split must say it is not exact (the pipeline then runs the layer's whole backward).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>

#include "tdist/pipeline/detail/split_backward.h"

namespace tdist::pipeline::detail {
namespace {

using Layer = std::function<at::Tensor(const at::Tensor&)>;

struct Grads {
  at::Tensor input;
  std::vector<at::Tensor> params;
};

std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) {
    out.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
    p.mutable_grad() = at::Tensor();
  }
  return out;
}

// The reference: one backward of the whole layer.
Grads whole(const Layer& layer, const std::vector<at::Tensor>& params, const at::Tensor& x0,
            const at::Tensor& g) {
  auto x = x0.clone().requires_grad_(true);
  torch::autograd::backward({layer(x)}, {g});
  return {x.grad().clone(), grads_of(params)};
}

// I then W, as a zero-bubble stage runs them; `exact` reports the split's verdict.
Grads split(const Layer& layer, const std::vector<at::Tensor>& params, const at::Tensor& x0,
            const at::Tensor& g, bool* exact) {
  auto x = x0.clone().requires_grad_(true);
  auto out = layer(x);
  LayerSplit s(x, out, params);
  *exact = s.exact();
  auto gx = torch::autograd::grad({out}, {x}, {g}, /*retain_graph=*/true)[0];
  // I leaves the parameters alone.
  for (const auto& p : params) EXPECT_FALSE(p.grad().defined());
  if (s.exact()) {
    s.weight_grads();
  } else {
    torch::autograd::backward({out}, {g}, /*retain_graph=*/false, /*create_graph=*/false, params);
  }
  return {gx, grads_of(params)};
}

void expect_same(const Grads& a, const Grads& b) {
  EXPECT_TRUE(torch::allclose(a.input, b.input, 1e-5, 1e-6));
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) {
    ASSERT_EQ(a.params[i].defined(), b.params[i].defined()) << "parameter " << i;
    if (a.params[i].defined()) {
      EXPECT_TRUE(torch::allclose(a.params[i], b.params[i], 1e-5, 1e-6))
          << "parameter " << i << " differs by " << (a.params[i] - b.params[i]).abs().max();
    }
  }
}

// Runs the case and returns the split's verdict; the gradients must match either way.
bool check(const Layer& layer, const std::vector<at::Tensor>& params, at::IntArrayRef in_shape) {
  torch::manual_seed(3);
  auto x = torch::randn(in_shape);
  auto g = torch::randn_like(layer(x).detach());
  const Grads ref = whole(layer, params, x, g);
  bool exact = false;
  const Grads got = split(layer, params, x, g, &exact);
  expect_same(ref, got);
  return exact;
}

TEST(LayerSplit, ATransformerBlockSplitsExactly) {
  torch::manual_seed(0);
  const int64_t w = 16, h = 4;
  torch::nn::LayerNorm ln1(torch::nn::LayerNormOptions({w})), ln2(torch::nn::LayerNormOptions({w}));
  torch::nn::Linear qkv(w, 3 * w), proj(w, w), fc(w, 4 * w), out(4 * w, w);
  Layer block = [&](const at::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), d = w / h;
    auto parts = qkv(ln1(x)).view({b, t, 3, h, d}).permute({2, 0, 3, 1, 4}).unbind(0);
    auto y = at::scaled_dot_product_attention(parts[0], parts[1], parts[2], {}, 0.0, true);
    auto r = x + proj(y.transpose(1, 2).reshape({b, t, w}));
    return r + out(at::gelu(fc(ln2(r))));
  };
  std::vector<at::Tensor> params;
  for (auto* m : std::vector<torch::nn::Module*>{ln1.get(), qkv.get(), proj.get(), ln2.get(),
                                                 fc.get(), out.get()}) {
    for (auto& p : m->parameters()) params.push_back(p);
  }
  EXPECT_TRUE(check(block, params, {2, 5, w}));
}

TEST(LayerSplit, ParameterOnlyPathsAndParallelUsesSplitExactly) {
  torch::manual_seed(1);
  auto s = torch::randn({6}).requires_grad_(true);  // scale through exp: a path of its own
  torch::nn::Linear a(6, 6);
  // The same weight on two parallel branches of the input's path (no branch below the other).
  Layer layer = [&](const at::Tensor& x) { return torch::tanh(a(x)) * s.exp() + a(torch::sin(x)); };
  std::vector<at::Tensor> params{s, a->weight, a->bias};
  EXPECT_TRUE(check(layer, params, {4, 6}));
}

TEST(LayerSplit, AParameterUsedAgainBelowItsForkRunsTheWholeBackward) {
  torch::manual_seed(2);
  torch::nn::Linear a(6, 6);
  // a's weight leaves the input's path at the outer call and again below it, at the inner one:
  // W from the outer fork would reach the inner use too.
  Layer layer = [&](const at::Tensor& x) { return a(torch::tanh(a(x))); };
  EXPECT_FALSE(check(layer, {a->weight, a->bias}, {4, 6}));
}

TEST(LayerSplit, UnusedParametersAndOutputsWithoutTheInput) {
  torch::manual_seed(4);
  torch::nn::Linear used(5, 5), unused(5, 5);
  Layer layer = [&](const at::Tensor& x) { return used(x); };
  std::vector<at::Tensor> params{used->weight, used->bias, unused->weight, unused->bias};
  EXPECT_TRUE(check(layer, params, {3, 5}));  // the unused ones get no gradient either way

  // An output that does not depend on the input: nothing to split.
  auto p = torch::randn({3, 5}).requires_grad_(true);
  auto x = torch::randn({3, 5}).requires_grad_(true);
  auto out = (p * 2).sum(0) + x.detach().sum(0);
  EXPECT_FALSE(LayerSplit(x, out, {p}).exact());
}

TEST(LayerSplit, WeightGradsBeforeTheInputPassIsAnError) {
  torch::nn::Linear a(4, 4);
  auto x = torch::randn({2, 4}).requires_grad_(true);
  auto out = a(x);
  LayerSplit s(x, out, {a->weight, a->bias});
  ASSERT_TRUE(s.exact());
  EXPECT_THROW(s.weight_grads(), std::exception);
}

}  // namespace
}  // namespace tdist::pipeline::detail
