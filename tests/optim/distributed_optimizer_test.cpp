// DistributedOptimizer against libtorch's local optimizers, over real RPC agents.
#include <gtest/gtest.h>

#include <thread>

#include "tdist/optim/distributed_optimizer.h"
#include "tests/autograd/autograd_test_util.h"
#include "tests/harness/expect.h"

namespace tdist::optim::test {
namespace {

using namespace std::chrono_literals;
using autograd::test::param;
using autograd::test::stage;
using tdist::test::expect_contains;
using tdist::test::expect_throw;

void register_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    rpc::register_function("opt.param_rref", [](std::string key) {
      return rpc::make_rref(param(rpc::current_agent()->info().name, key));
    });
    rpc::register_function("opt.linear", [](std::string key, at::Tensor x) {
      return x.matmul(param(rpc::current_agent()->info().name, key));
    });
  });
}

class DistOptim : public ::testing::Test {
 protected:
  void SetUp() override {
    register_once();
    torch::manual_seed(11);
    autograd::test::clear_params();
    rpc::RpcOptions o;
    o.rpc_timeout = 10s;
    agents_ = autograd::test::start(3, o);
    rpc::set_current_agent(agents_[0]);
  }
  void TearDown() override {
    rpc::set_current_agent(nullptr);
    rpc::test::shutdown_all(agents_, !killed_);
    autograd::test::clear_params();
  }
  rpc::RRef<at::Tensor> remote_param(const std::string& worker, const std::string& key) {
    return rpc::rpc_sync<rpc::RRef<at::Tensor>>(worker, "opt.param_rref", key);
  }
  autograd::test::Agents agents_;
  bool killed_ = false;
};

at::Tensor leaf(std::vector<int64_t> shape) {
  return torch::randn(shape, torch::kFloat64).requires_grad_(true);
}

struct Case {
  std::string name;
  OptimizerSpec spec;
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)> local;
};

std::vector<Case> cases() {
  namespace o = torch::optim;
  std::vector<Case> c;
  auto sgd = o::SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(0.01);
  c.push_back({"SGD(momentum, nesterov, weight decay)", OptimizerSpec::sgd(sgd),
               [sgd](auto p) { return std::make_unique<o::SGD>(p, sgd); }});
  auto sgd2 = o::SGDOptions(0.05).momentum(0.5).dampening(0.1);
  c.push_back({"SGD(momentum, dampening)", OptimizerSpec::sgd(sgd2),
               [sgd2](auto p) { return std::make_unique<o::SGD>(p, sgd2); }});
  auto adam = o::AdamOptions(0.01).betas({0.8, 0.99}).weight_decay(0.001).amsgrad(true);
  c.push_back({"Adam", OptimizerSpec::adam(adam),
               [adam](auto p) { return std::make_unique<o::Adam>(p, adam); }});
  auto adamw = o::AdamWOptions(0.02).weight_decay(0.05);
  c.push_back({"AdamW", OptimizerSpec::adamw(adamw),
               [adamw](auto p) { return std::make_unique<o::AdamW>(p, adamw); }});
  auto rms = o::RMSpropOptions(0.01).momentum(0.3).centered(true);
  c.push_back({"RMSprop", OptimizerSpec::rmsprop(rms),
               [rms](auto p) { return std::make_unique<o::RMSprop>(p, rms); }});
  auto ada = o::AdagradOptions(0.1).lr_decay(0.01).initial_accumulator_value(0.1);
  c.push_back({"Adagrad", OptimizerSpec::adagrad(ada),
               [ada](auto p) { return std::make_unique<o::Adagrad>(p, ada); }});
  return c;
}

TEST_F(DistOptim, EqualsALocalOptimizerAfterKStepsForEachOptimizer) {
  constexpr int kSteps = 4;
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    at::Tensor a = leaf({3, 3});      // on w0 (the trainer)
    param("w1", "b") = leaf({3, 4});  // on w1
    param("w2", "c") = leaf({4, 1});  // on w2
    at::Tensor b = param("w1", "b"), cc = param("w2", "c");
    auto ar = a.detach().clone().requires_grad_(true);
    auto br = b.detach().clone().requires_grad_(true);
    auto cr = cc.detach().clone().requires_grad_(true);
    DistributedOptimizer opt(c.spec,
                             {rpc::make_rref(a), remote_param("w1", "b"), remote_param("w2", "c")});
    EXPECT_EQ(opt.owners(), (std::vector<std::string>{"w0", "w1", "w2"}));
    auto local = c.local({ar, br, cr});
    for (int step = 0; step < kSteps; ++step) {
      at::Tensor x = torch::randn({5, 3}, torch::kFloat64);
      {
        autograd::Context ctx;
        at::Tensor h = rpc::rpc_sync<at::Tensor>("w1", "ag.stage", std::string("b"), stage(x, a));
        at::Tensor y = rpc::rpc_sync<at::Tensor>("w2", "ag.stage", std::string("c"), h);
        autograd::backward(ctx.id(), {y.pow(2).mean()});
        opt.step(ctx.id());
      }
      local->zero_grad();
      stage(stage(stage(x, ar), br), cr).pow(2).mean().backward();
      local->step();
    }
    EXPECT_TRUE(torch::allclose(a, ar, 0, 1e-6)) << (a - ar).abs().max().item<double>();
    EXPECT_TRUE(torch::allclose(b, br, 0, 1e-6)) << (b - br).abs().max().item<double>();
    EXPECT_TRUE(torch::allclose(cc, cr, 0, 1e-6)) << (cc - cr).abs().max().item<double>();
    EXPECT_FALSE(b.grad().defined()) << "the owner's .grad is left empty";
  }
}

TEST_F(DistOptim, ConcurrentStepsFromTwoTrainersAreBothApplied) {
  param("w2", "c") = torch::zeros({3, 1}, torch::kFloat64).requires_grad_(true);
  at::Tensor c = param("w2", "c");
  const double lr = 0.5;
  // Each trainer's loss is sum(x @ c): its gradient wrt c is x's column sums.
  auto trainer = [&](int rank, double v) {
    autograd::test::as_worker(agents_[rank], [&] {
      DistributedOptimizer opt(
          OptimizerSpec::sgd(torch::optim::SGDOptions(lr)),
          {rpc::rpc_sync<rpc::RRef<at::Tensor>>("w2", "opt.param_rref", std::string("c"))});
      for (int i = 0; i < 10; ++i) {
        autograd::Context ctx;
        at::Tensor x = torch::full({2, 3}, v, torch::kFloat64);
        at::Tensor z = rpc::rpc_sync<at::Tensor>("w2", "opt.linear", std::string("c"), x);
        autograd::backward(ctx.id(), {z.sum()});
        opt.step(ctx.id());
      }
      return 0;
    });
  };
  std::thread t0([&] { trainer(0, 1.0); });
  std::thread t1([&] { trainer(1, 2.0); });
  t0.join();
  t1.join();
  // 10 steps of each: c -= lr * 2 * v per step (the column sums of a 2x3 matrix of v).
  at::Tensor want = torch::full({3, 1}, -lr * 2 * (1.0 + 2.0) * 10, torch::kFloat64);
  EXPECT_TRUE(torch::allclose(c, want)) << c;
}

TEST_F(DistOptim, StateCanBeSavedAndLoaded) {
  param("w1", "b") = leaf({3, 2});
  at::Tensor b = param("w1", "b");
  auto spec = OptimizerSpec::adam(torch::optim::AdamOptions(0.05));
  auto params = std::vector<rpc::RRef<at::Tensor>>{remote_param("w1", "b")};
  DistributedOptimizer opt(spec, params);
  auto step = [&](DistributedOptimizer& o, int seed) {
    torch::manual_seed(seed);
    at::Tensor x = torch::randn({4, 3}, torch::kFloat64);
    autograd::Context ctx;
    auto y = rpc::rpc_sync<at::Tensor>("w1", "ag.stage", std::string("b"), x);
    autograd::backward(ctx.id(), {y.sum()});
    o.step(ctx.id());
  };
  step(opt, 1);
  step(opt, 2);
  auto state = opt.state_dict();
  ASSERT_EQ(state.size(), 1u);
  EXPECT_FALSE(state.at("w1").empty());
  at::Tensor saved = b.detach().clone();
  step(opt, 3);
  at::Tensor after = b.detach().clone();

  auto restore = [&] {
    torch::NoGradGuard g;
    b.copy_(saved);
  };
  restore();
  DistributedOptimizer fresh(spec, params);
  step(fresh, 3);
  EXPECT_FALSE(torch::allclose(b, after)) << "a fresh Adam state should step differently";
  restore();
  DistributedOptimizer loaded(spec, params);
  loaded.load_state_dict(state);
  step(loaded, 3);
  EXPECT_TRUE(torch::allclose(b, after, 0, 1e-12));
  expect_contains(expect_throw<InvalidArgument>([&] {
                    loaded.load_state_dict({{"w9", ""}});
                  }),
                  "no owner 'w9'");
}

TEST_F(DistOptim, AFailingOwnerFailsStepNamingIt) {
  param("w1", "b") = leaf({3, 2});
  param("w2", "c") = leaf({2, 1});
  DistributedOptimizer opt(OptimizerSpec::sgd(torch::optim::SGDOptions(0.1)),
                           {remote_param("w1", "b"), remote_param("w2", "c")});
  {
    // w2 never saw this context: its step fails, naming it.
    autograd::Context ctx;
    auto y = rpc::rpc_sync<at::Tensor>("w1", "ag.stage", std::string("b"),
                                       torch::randn({4, 3}, torch::kFloat64));
    autograd::backward(ctx.id(), {y.sum()});
    expect_contains(expect_throw<Error>([&] { opt.step(ctx.id()); }), "owner 'w2'");
  }
  autograd::Context ctx;
  auto h = rpc::rpc_sync<at::Tensor>("w1", "ag.stage", std::string("b"),
                                     torch::randn({4, 3}, torch::kFloat64));
  auto y = rpc::rpc_sync<at::Tensor>("w2", "ag.stage", std::string("c"), h);
  autograd::backward(ctx.id(), {y.sum()});
  agents_[2]->shutdown(false);
  killed_ = true;
  expect_contains(expect_throw<Error>([&] { opt.step(ctx.id()); }), "owner 'w2'");
}

}  // namespace
}  // namespace tdist::optim::test
