// Gradient parity: distributed autograd across real RPC agents against the same model computed
// in one process with libtorch's own autograd (to 1e-6, in float64).
#include <gtest/gtest.h>

#include "tests/autograd/autograd_test_util.h"

namespace tdist::autograd::test {
namespace {

using namespace std::chrono_literals;

at::Tensor copy(const at::Tensor& t) { return t.detach().clone().requires_grad_(true); }

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << ": no gradient";
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(torch::allclose(got, want, /*rtol=*/0, /*atol=*/1e-6))
      << what << ": max difference " << (got - want).abs().max().item<double>();
}

class AutogradParity : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(7);
    clear_params();
    agents_ = start(3);
    rpc::set_current_agent(agents_[0]);
  }
  void TearDown() override {
    EXPECT_TRUE(all_released(agents_));
    rpc::set_current_agent(nullptr);
    rpc::test::shutdown_all(agents_);
    clear_params();
  }
  // Gradient of `key` on worker i in context id.
  at::Tensor grad_on(int i, int64_t id, const at::Tensor& p) {
    auto g = gradients_on(agents_[i], id);
    auto it = g.find(p);
    return it == g.end() ? at::Tensor() : it->second;
  }
  Agents agents_;
};

TEST_F(AutogradParity, ChainAcrossTwoWorkers) {
  at::Tensor x = leaf({4, 3});
  at::Tensor& a = param("w0", "a") = leaf({3, 3});
  at::Tensor& b = param("w1", "b") = leaf({3, 2});
  {
    Context ctx;
    at::Tensor y = rpc::rpc_sync<at::Tensor>("w1", "ag.stage", std::string("b"), stage(x, a));
    backward(ctx.id(), {y.pow(2).sum()});
    auto xr = copy(x), ar = copy(a), br = copy(b);
    auto ref = torch::autograd::grad({stage(stage(xr, ar), br).pow(2).sum()}, {xr, ar, br});
    expect_close(grad_on(0, ctx.id(), x), ref[0], "x");
    expect_close(grad_on(0, ctx.id(), a), ref[1], "a");
    expect_close(grad_on(1, ctx.id(), b), ref[2], "b");
    EXPECT_FALSE(x.grad().defined()) << "distributed backward must not write .grad";
    EXPECT_FALSE(b.grad().defined());
  }
}

TEST_F(AutogradParity, ChainAcrossThreeWorkers) {
  at::Tensor x = leaf({5, 3});
  at::Tensor& b = param("w1", "b") = leaf({3, 4});
  at::Tensor& c = param("w2", "c") = leaf({4, 2});
  Context ctx;
  at::Tensor h = rpc::rpc_sync<at::Tensor>("w1", "ag.stage", std::string("b"), x);
  at::Tensor y = rpc::rpc_sync<at::Tensor>("w2", "ag.stage", std::string("c"), h);
  backward(ctx.id(), {(y * y).mean()});
  auto xr = copy(x), br = copy(b), cr = copy(c);
  auto ref = torch::autograd::grad({(stage(stage(xr, br), cr).pow(2)).mean()}, {xr, br, cr});
  expect_close(grad_on(0, ctx.id(), x), ref[0], "x");
  expect_close(grad_on(1, ctx.id(), b), ref[1], "b");
  expect_close(grad_on(2, ctx.id(), c), ref[2], "c");
}

TEST_F(AutogradParity, BranchingGraph) {
  at::Tensor x = leaf({4, 3});
  at::Tensor& a = param("w0", "a") = leaf({3, 3});
  at::Tensor& b = param("w1", "b") = leaf({3, 3});
  at::Tensor& c = param("w2", "c") = leaf({3, 3});
  Context ctx;
  auto f1 = rpc::rpc_async<at::Tensor>("w1", "ag.stage", std::string("b"), x);
  auto f2 = rpc::rpc_async<at::Tensor>("w2", "ag.stage", std::string("c"), x);
  at::Tensor loss = (f1.value() * f2.value()).sum() + stage(x, a).sum();
  backward(ctx.id(), {loss});
  auto xr = copy(x), ar = copy(a), br = copy(b), cr = copy(c);
  auto ref = torch::autograd::grad({(stage(xr, br) * stage(xr, cr)).sum() + stage(xr, ar).sum()},
                                   {xr, ar, br, cr});
  expect_close(grad_on(0, ctx.id(), x), ref[0], "x");
  expect_close(grad_on(0, ctx.id(), a), ref[1], "a");
  expect_close(grad_on(1, ctx.id(), b), ref[2], "b");
  expect_close(grad_on(2, ctx.id(), c), ref[3], "c");
}

TEST_F(AutogradParity, TensorCrossesTheSameWorkerTwice) {
  at::Tensor x = leaf({4, 3});
  at::Tensor& a = param("w0", "a") = leaf({3, 3});
  at::Tensor& b = param("w1", "b") = leaf({3, 3});
  Context ctx;
  at::Tensor h1 = rpc::rpc_sync<at::Tensor>("w1", "ag.stage", std::string("b"), x);
  at::Tensor h2 = stage(h1, a);
  at::Tensor h3 = rpc::rpc_sync<at::Tensor>("w1", "ag.stage", std::string("b"), h2);
  backward(ctx.id(), {h3.sum()});
  auto xr = copy(x), ar = copy(a), br = copy(b);
  auto ref = torch::autograd::grad({stage(stage(stage(xr, br), ar), br).sum()}, {xr, ar, br});
  expect_close(grad_on(0, ctx.id(), x), ref[0], "x");
  expect_close(grad_on(0, ctx.id(), a), ref[1], "a");
  expect_close(grad_on(1, ctx.id(), b), ref[2], "b (used twice on w1)");
}

TEST_F(AutogradParity, TensorUsedTwice) {
  at::Tensor x = leaf({4, 3});
  at::Tensor& a = param("w0", "a") = leaf({3, 3});
  at::Tensor& b = param("w1", "b") = leaf({3, 3});
  Context ctx;
  at::Tensor h = stage(x, a);
  // h twice in one message, again in a second message, and locally.
  at::Tensor y = rpc::rpc_sync<at::Tensor>("w1", "ag.mul", h, h);
  at::Tensor z = rpc::rpc_sync<at::Tensor>("w1", "ag.stage", std::string("b"), h);
  backward(ctx.id(), {y.sum() + z.sum() + h.sum()});
  auto xr = copy(x), ar = copy(a), br = copy(b);
  auto hr = stage(xr, ar);
  auto ref =
      torch::autograd::grad({(hr * hr).sum() + stage(hr, br).sum() + hr.sum()}, {xr, ar, br});
  expect_close(grad_on(0, ctx.id(), x), ref[0], "x");
  expect_close(grad_on(0, ctx.id(), a), ref[1], "a");
  expect_close(grad_on(1, ctx.id(), b), ref[2], "b");
}

TEST_F(AutogradParity, RemoteResultUsedOnAThirdWorker) {
  at::Tensor x = leaf({4, 3});
  at::Tensor& b = param("w1", "b") = leaf({3, 3});
  at::Tensor& c = param("w2", "c") = leaf({3, 2});
  Context ctx;
  auto r = rpc::remote<at::Tensor>("w1", "ag.stage", std::string("b"), x);
  at::Tensor z = rpc::rpc_sync<at::Tensor>("w2", "ag.stage_of_rref", std::string("c"), r);
  backward(ctx.id(), {z.sum()});
  auto xr = copy(x), br = copy(b), cr = copy(c);
  auto ref = torch::autograd::grad({stage(stage(xr, br), cr).sum()}, {xr, br, cr});
  expect_close(grad_on(0, ctx.id(), x), ref[0], "x");
  expect_close(grad_on(1, ctx.id(), b), ref[1], "b");
  expect_close(grad_on(2, ctx.id(), c), ref[2], "c");
}

TEST_F(AutogradParity, NestedRpcBackToTheCaller) {
  at::Tensor x = leaf({4, 3});
  at::Tensor& a = param("w0", "a") = leaf({2, 3});
  at::Tensor& b = param("w1", "b") = leaf({3, 4});
  at::Tensor& c = param("w2", "c") = leaf({4, 2});
  Context ctx;
  using Chain = std::vector<std::pair<std::string, std::string>>;
  // w0 -> w1 (stage b) -> w2 (stage c) -> w0 (stage a), results back along the same path.
  at::Tensor z = rpc::rpc_sync<at::Tensor>("w1", "ag.chain", Chain{{"w2", "c"}, {"w0", "a"}},
                                           std::string("b"), x);
  backward(ctx.id(), {z.sum() + x.sum()});
  auto xr = copy(x), ar = copy(a), br = copy(b), cr = copy(c);
  auto ref = torch::autograd::grad({stage(stage(stage(xr, br), cr), ar).sum() + xr.sum()},
                                   {xr, ar, br, cr});
  expect_close(grad_on(0, ctx.id(), x), ref[0], "x");
  expect_close(grad_on(0, ctx.id(), a), ref[1], "a (nested call back to w0)");
  expect_close(grad_on(1, ctx.id(), b), ref[2], "b");
  expect_close(grad_on(2, ctx.id(), c), ref[3], "c");
}

}  // namespace
}  // namespace tdist::autograd::test
