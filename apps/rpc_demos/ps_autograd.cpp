// tdist-rpc-ps-autograd: a parameter server with several trainers using distributed autograd and
// the DistributedOptimizer (the shape of PyTorch's parameter-server RPC tutorial).
//
//   tdist-run --nproc-per-node 3 tdist-rpc-ps-autograd --steps 100
//
// Rank 0 ("ps") holds the model, a linear classifier 16 -> 4 (softmax regression). Ranks 1..N
// ("trainer<r>") each draw their own batches of a learnable synthetic task (4 Gaussian clusters in
// 16 dimensions), run the model's forward on the server over RPC inside a distributed autograd
// context, compute the loss locally, run distributed backward, and step their DistributedOptimizer
// (SGD), which applies the gradients on the server. Trainers run concurrently, without waiting
// for each other. When all are done the server prints the model's accuracy on held-out samples
// and exits 1 if it is below --min-accuracy.
//
// The model is one layer on purpose: its input (the data) does not require grad, so its forward
// saves no parameter for backward, and another trainer's optimizer step updating the parameters
// in place between this trainer's forward and backward cannot invalidate this trainer's graph.
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <cstdio>

#include "tdist/autograd/context.h"
#include "tdist/core/env.h"
#include "tdist/optim/distributed_optimizer.h"
#include "tdist/rpc/api.h"

namespace rpc = tdist::rpc;
namespace dist_autograd = tdist::autograd;

namespace {

constexpr int64_t kFeatures = 16, kClasses = 4;

// The server's model, created on first use (only the server calls this).
torch::nn::Linear& server_model() {
  static torch::nn::Linear model = [] {
    torch::manual_seed(0);
    return torch::nn::Linear(kFeatures, kClasses);
  }();
  return model;
}

// Samples of the task: class c is a Gaussian (std 1) around centre c (fixed, 3 apart on average).
struct Batch {
  at::Tensor x, y;
};
Batch make_batch(int64_t size, at::Generator& gen) {
  auto centre_gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  at::Tensor centres = 1.5 * at::randn({kClasses, kFeatures}, centre_gen);
  at::Tensor y = at::randint(kClasses, {size}, gen, at::kLong);
  at::Tensor x = centres.index_select(0, y) + at::randn({size, kFeatures}, gen);
  return {x, y};
}

int run_trainer(int rank, int64_t steps, int64_t batch, double lr) {
  auto params = rpc::rpc_sync<std::vector<rpc::RRef<at::Tensor>>>("ps", "ps_parameter_rrefs");
  tdist::optim::DistributedOptimizer opt(
      tdist::optim::OptimizerSpec::sgd(torch::optim::SGDOptions(lr)), params);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + rank);
  double first = 0, last = 0;
  for (int64_t step = 0; step < steps; ++step) {
    Batch b = make_batch(batch, gen);
    dist_autograd::Context ctx;
    at::Tensor logits = rpc::rpc_sync<at::Tensor>("ps", "ps_forward", b.x);
    at::Tensor loss = torch::cross_entropy_loss(logits, b.y);
    dist_autograd::backward(ctx.id(), {loss});
    opt.step(ctx.id());
    last = loss.item<double>();
    if (step == 0) first = last;
  }
  std::printf("trainer%d: loss %.4f -> %.4f over %lld steps\n", rank, first, last,
              static_cast<long long>(steps));
  return 0;
}

double server_accuracy(int64_t samples) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  Batch b = make_batch(samples, gen);
  torch::NoGradGuard no_grad;
  at::Tensor pred = server_model()->forward(b.x).argmax(1);
  return pred.eq(b.y).to(at::kDouble).mean().item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  int64_t steps = 100, batch = 32, test_samples = 2000;
  double lr = 0.1, min_accuracy = 0.9;
  CLI::App app{"tdist-rpc-ps-autograd: a parameter server (rank 0) and trainers (ranks 1..N) "
               "training with distributed autograd and the DistributedOptimizer; start it with "
               "tdist-run --nproc-per-node N+1"};
  app.add_option("--steps", steps, "training steps per trainer");
  app.add_option("--batch", batch, "samples per step");
  app.add_option("--lr", lr, "SGD learning rate");
  app.add_option("--test-samples", test_samples, "held-out samples the server evaluates");
  app.add_option("--min-accuracy", min_accuracy, "exit 1 when the final accuracy is below this");
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(1);
    rpc::register_function("ps_forward", [](at::Tensor x) { return server_model()->forward(x); });
    rpc::register_function("ps_parameter_rrefs", [] {
      std::vector<rpc::RRef<at::Tensor>> out;
      for (auto& p : server_model()->parameters()) out.push_back(rpc::make_rref(p));
      return out;
    });
    const auto env = tdist::env::read_dist_env();
    if (env.world_size < 2) {
      throw tdist::InvalidArgument("tdist-rpc-ps-autograd needs a server and at least one trainer");
    }
    const std::string name = env.rank == 0 ? "ps" : "trainer" + std::to_string(env.rank);
    rpc::init_rpc(name, env.rank, env.world_size);
    int rc = 0;
    if (env.rank == 0) {
      server_model();
      rpc::shutdown();  // serves until every trainer is done
      const double acc = server_accuracy(test_samples);
      std::printf("ps: accuracy %.4f on %lld held-out samples after %d trainers x %lld steps\n",
                  acc, static_cast<long long>(test_samples), env.world_size - 1,
                  static_cast<long long>(steps));
      if (!(acc >= min_accuracy)) rc = 1;
    } else {
      rc = run_trainer(env.rank, steps, batch, lr);
      rpc::shutdown();
    }
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-rpc-ps-autograd: %s\n", e.what());
    return 1;
  }
}
