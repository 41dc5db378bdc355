// DistributedDataParallel under distributed autograd: DDP's Reducer hooks fire when
// tdist::autograd::backward reaches its parameters, and the gradients a context holds for them
// are the averages across the DDP group (Note [DDP bucketing] 9 in ddp/reducer.h); .grad stays
// untouched. Two workers are agents and DDP ranks at once (threads of this process).
#include <gtest/gtest.h>

#include "tdist/comm/process_group.h"
#include "tdist/ddp/distributed_data_parallel.h"
#include "tests/autograd/autograd_test_util.h"
#include "tests/harness/spawn.h"

namespace tdist::autograd::test {
namespace {

constexpr int kWorld = 2;

// The gradient of `p` in `g`, undefined when absent.
at::Tensor grad_of(const GradientMap& g, const at::Tensor& p) {
  auto it = g.find(p);
  return it == g.end() ? at::Tensor() : it->second;
}

// The loss of one rank's batch (the model's output squared, summed).
at::Tensor loss_of(const at::Tensor& out) { return out.pow(2).sum(); }

class AutogradDdp : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(11);
    agents_ = start(kWorld);
    init_ = torch::nn::Linear(3, 2);
    init_->to(torch::kFloat64);
    for (int r = 0; r < kWorld; ++r) inputs_.push_back(torch::randn({5, 3}, torch::kFloat64));
  }
  void TearDown() override {
    EXPECT_TRUE(all_released(agents_));
    rpc::test::shutdown_all(agents_);
  }

  // The average over the ranks of d loss / d {weight, bias}, computed in one process.
  std::vector<at::Tensor> expected_average(const torch::nn::Linear& start) {
    std::vector<at::Tensor> sum;
    for (int r = 0; r < kWorld; ++r) {
      at::Tensor w = start->weight.detach().clone().requires_grad_(true);
      at::Tensor b = start->bias.detach().clone().requires_grad_(true);
      auto g = torch::autograd::grad({loss_of(torch::linear(inputs_[r], w, b))}, {w, b});
      if (sum.empty()) {
        sum = g;
      } else {
        for (size_t i = 0; i < g.size(); ++i) sum[i] = sum[i] + g[i];
      }
    }
    for (auto& s : sum) s = s / kWorld;
    return sum;
  }

  Agents agents_;
  torch::nn::Linear init_{nullptr};
  std::vector<at::Tensor> inputs_;
};

TEST_F(AutogradDdp, ContextsHoldTheAveragedGradientsForTwoIterations) {
  std::vector<std::vector<at::Tensor>> want(2);
  // got[rank][iteration] = {weight's gradient, bias's gradient} in that iteration's context.
  std::vector<std::vector<std::vector<at::Tensor>>> got(kWorld,
                                                        std::vector<std::vector<at::Tensor>>(2));
  std::vector<torch::nn::Linear> nets(kWorld, nullptr);
  tdist::test::spawn(kWorld, [&](int rank, std::shared_ptr<Store> store) {
    as_worker(agents_[rank], [&] {
      auto pg = comm::create_process_group(store, rank, kWorld);
      torch::nn::Linear net(3, 2);  // each rank's own initialisation: DDP takes rank 0's
      net->to(torch::kFloat64);
      if (rank == 0) {
        torch::NoGradGuard no_grad;
        net->weight.copy_(init_->weight);
        net->bias.copy_(init_->bias);
      }
      nets[rank] = net;
      ddp::DistributedDataParallel<torch::nn::Linear> model(net, pg);
      for (int it = 0; it < 2; ++it) {
        Context ctx;
        backward(ctx.id(), {loss_of(model(inputs_[rank]))});
        auto g = get_gradients(ctx.id());
        got[rank][it] = {grad_of(g, net->weight), grad_of(g, net->bias)};
        // Between iterations, move the parameters (the same on both ranks) so the second
        // iteration's gradients differ from the first's.
        torch::NoGradGuard no_grad;
        net->weight.sub_(0.1 * got[rank][it][0]);
        net->bias.sub_(0.1 * got[rank][it][1]);
      }
    });
  });
  // The expected averages, at the parameters each iteration started from.
  torch::nn::Linear start(3, 2);
  start->to(torch::kFloat64);
  {
    torch::NoGradGuard no_grad;
    start->weight.copy_(init_->weight);
    start->bias.copy_(init_->bias);
  }
  for (int it = 0; it < 2; ++it) {
    want[it] = expected_average(start);
    torch::NoGradGuard no_grad;
    start->weight.sub_(0.1 * want[it][0]);
    start->bias.sub_(0.1 * want[it][1]);
  }
  for (int rank = 0; rank < kWorld; ++rank) {
    for (int it = 0; it < 2; ++it) {
      for (size_t i = 0; i < 2; ++i) {
        const at::Tensor& g = got[rank][it][i];
        ASSERT_TRUE(g.defined()) << "rank " << rank << " iteration " << it << " param " << i;
        EXPECT_TRUE(torch::allclose(g, want[it][i], /*rtol=*/0, /*atol=*/1e-12))
            << "rank " << rank << " iteration " << it << " param " << i << ": got " << g
            << " want the average " << want[it][i];
      }
    }
    for (const auto& p : nets[rank]->parameters()) {
      EXPECT_FALSE(p.grad().defined()) << "distributed backward must not write .grad";
    }
  }
}

}  // namespace
}  // namespace tdist::autograd::test
