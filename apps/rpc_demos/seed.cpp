// tdist-rpc-seed: the model-parallel seed example (PyTorch's distributed overview, in C++).
//
//   MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 tdist-rpc-seed --rank 1 --world-size 2 &
//   MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 tdist-rpc-seed --rank 0 --world-size 2
//   tdist-run --standalone --nproc-per-node 2 tdist-rpc-seed
//
// Node A (rank 0) creates a Net (one linear layer, 2 -> 1, no bias) on node B (rank 1) with
// remote(), gets RRefs to its parameters, trains it on A's 8 samples with distributed autograd
// and the DistributedOptimizer (SGD), then pulls the trained layer back (to_here) and prints its
// weight. B only serves.
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include <cstdio>

#include "apps/rpc_demos/seed_model.h"
#include "tdist/autograd/context.h"
#include "tdist/core/env.h"
#include "tdist/optim/distributed_optimizer.h"
#include "tdist/rpc/api.h"

namespace rpc = tdist::rpc;
namespace dist_autograd = tdist::autograd;
namespace seed = tdist::demo::seed;

namespace {

// The Net as it lives on B: the module, reachable through an RRef. Sending it (to_here) sends
// its weight.
class RemoteNet {
 public:
  RemoteNet() : net_(seed::initial_weight()) {}
  explicit RemoteNet(std::vector<double> w) : net_(w) {}
  at::Tensor forward(at::Tensor x) { return net_->forward(x); }
  std::vector<rpc::RRef<at::Tensor>> parameter_rrefs() {
    return tdist::optim::parameter_rrefs(*net_);
  }
  at::Tensor weight() const { return net_->fc->weight; }

  template <class Archive>
  void save(Archive& ar) const {
    ar(net_->fc->weight.detach());
  }
  template <class Archive>
  void load(Archive& ar) {
    at::Tensor w;
    ar(w);
    torch::NoGradGuard no_grad;
    net_->fc->weight.copy_(w);
  }

 private:
  seed::Net net_;
};

}  // namespace

int main(int argc, char** argv) {
  int rank = -1, world_size = -1;
  int64_t steps = seed::kDefaultSteps;
  double lr = seed::kDefaultLr;
  CLI::App app{
      "tdist-rpc-seed: node A trains a Net that lives on node B with distributed "
      "autograd and the DistributedOptimizer"};
  app.add_option("--rank", rank,
                 "0 (node A, trains) or 1 (node B, holds the Net); default: "
                 "from the environment (tdist-run, RANK)");
  app.add_option("--world-size", world_size, "2; default: from the environment");
  app.add_option("--steps", steps, "training steps");
  app.add_option("--lr", lr, "SGD learning rate");
  CLI11_PARSE(app, argc, argv);

  try {
    at::set_num_threads(1);
    rpc::register_class<RemoteNet>("Net")
        .constructor<std::vector<double>>()
        .method("forward", &RemoteNet::forward)
        .method("parameter_rrefs", &RemoteNet::parameter_rrefs);

    rpc::RpcOptions options;
    if (rank >= 0 || world_size >= 0) {
      if (rank < 0 || world_size < 0)
        throw tdist::InvalidArgument("give both --rank and --world-size");
      auto master = tdist::env::read_master_address();
      options.init_method = "tcp://" + master.host + ":" + std::to_string(master.port);
    } else {
      auto env = tdist::env::read_dist_env();
      rank = env.rank;
      world_size = env.world_size;
    }
    if (world_size != 2) throw tdist::InvalidArgument("tdist-rpc-seed runs on exactly 2 workers");
    rpc::init_rpc(rank == 0 ? "A" : "B", rank, world_size, options);
    if (rank == 0) {
      auto net = rpc::remote<RemoteNet>("B", "Net", seed::initial_weight());
      auto params = net.rpc_sync<std::vector<rpc::RRef<at::Tensor>>>("parameter_rrefs");
      tdist::optim::DistributedOptimizer opt(
          tdist::optim::OptimizerSpec::sgd(torch::optim::SGDOptions(lr)), params);
      const at::Tensor x = seed::inputs(), y = seed::targets();
      for (int64_t step = 0; step < steps; ++step) {
        dist_autograd::Context ctx;
        at::Tensor loss = torch::mse_loss(net.rpc_sync<at::Tensor>("forward", x), y);
        dist_autograd::backward(ctx.id(), {loss});
        opt.step(ctx.id());
        if (step % 10 == 0 || step + 1 == steps) {
          std::printf("step %lld: loss %.6f\n", static_cast<long long>(step), loss.item<double>());
        }
      }
      RemoteNet trained = net.to_here();
      at::Tensor w = trained.weight();
      std::printf("trained weight: %.9f %.9f\n", w[0][0].item<double>(), w[0][1].item<double>());
    }
    rpc::shutdown();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-rpc-seed: %s\n", e.what());
    return 1;
  }
}
