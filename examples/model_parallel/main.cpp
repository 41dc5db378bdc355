// Worker "A" (rank 0) creates a Net on worker "B" (rank 1) over RPC, trains it from A with
// distributed autograd and the DistributedOptimizer, and checks the trained weight against the
// same training done locally with plain libtorch.
//   tdist-run --standalone --nproc-per-node 2 ./model_parallel_example
#include <torch/torch.h>

#include <cstdio>

#include "tdist/autograd/context.h"
#include "tdist/core/env.h"
#include "tdist/optim/distributed_optimizer.h"
#include "tdist/rpc/api.h"

namespace rpc = tdist::rpc;
namespace dist_autograd = tdist::autograd;

constexpr int kSteps = 40;
constexpr double kLr = 0.05;

// One linear layer 2 -> 1 with a fixed starting weight, so that A's reference starts equal.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc(register_module("fc", torch::nn::Linear(torch::nn::LinearOptions(2, 1).bias(false)))) {
    torch::NoGradGuard no_grad;
    fc->weight.copy_(torch::tensor({{0.3f, -0.2f}}));
  }
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Net);

// What B holds behind the RRef that A gets: the methods A may call.
class RemoteNet {
 public:
  torch::Tensor forward(torch::Tensor x) { return net_(x); }
  std::vector<rpc::RRef<torch::Tensor>> parameter_rrefs() {
    return tdist::optim::parameter_rrefs(*net_);
  }
  torch::Tensor weight() { return net_->fc->weight.detach().clone(); }

 private:
  Net net_;
};

int main() {
  torch::set_num_threads(1);
  rpc::register_class<RemoteNet>("Net")
      .constructor<>()
      .method("forward", &RemoteNet::forward)
      .method("parameter_rrefs", &RemoteNet::parameter_rrefs)
      .method("weight", &RemoteNet::weight);
  const auto env = tdist::env::read_dist_env();  // RANK, WORLD_SIZE (tdist-run sets them)
  rpc::init_rpc(env.rank == 0 ? "A" : "B", env.rank, env.world_size);  // env:// rendezvous
  bool ok = true;
  if (env.rank == 0) {
    // y = 1.5 x0 - 0.5 x1 + 0.25 on 8 samples.
    const torch::Tensor x = torch::tensor({{1.0f, 2.0f},
                                           {2.0f, 1.0f},
                                           {-1.0f, 0.5f},
                                           {0.5f, -1.5f},
                                           {3.0f, 0.0f},
                                           {0.0f, -2.0f},
                                           {-2.0f, -1.0f},
                                           {1.5f, 1.5f}});
    const torch::Tensor y = (1.5 * x.select(1, 0) - 0.5 * x.select(1, 1) + 0.25).unsqueeze(1);

    rpc::RRef<RemoteNet> net = rpc::remote<RemoteNet>("B", "Net");
    tdist::optim::DistributedOptimizer opt(
        tdist::optim::OptimizerSpec::sgd(torch::optim::SGDOptions(kLr)),
        net.rpc_sync<std::vector<rpc::RRef<torch::Tensor>>>("parameter_rrefs"));
    for (int step = 0; step < kSteps; ++step) {
      dist_autograd::Context ctx;
      torch::Tensor loss = torch::mse_loss(net.rpc_sync<torch::Tensor>("forward", x), y);
      dist_autograd::backward(ctx.id(), {loss});  // through B's layer, over RPC
      opt.step(ctx.id());                         // SGD on B, with this context's gradients
      if (step % 10 == 0) std::printf("step %2d: loss %.6f\n", step, loss.item<double>());
    }
    const torch::Tensor remote_w = net.rpc_sync<torch::Tensor>("weight");

    Net local;  // the reference: the same training in this process
    torch::optim::SGD local_opt(local->parameters(), torch::optim::SGDOptions(kLr));
    for (int step = 0; step < kSteps; ++step) {
      local_opt.zero_grad();
      torch::mse_loss(local(x), y).backward();
      local_opt.step();
    }
    const double diff = (remote_w - local->fc->weight).abs().max().item<double>();
    std::printf("weight trained on B: %.6f %.6f; local reference differs by %g\n",
                remote_w[0][0].item<double>(), remote_w[0][1].item<double>(), diff);
    ok = diff <= 1e-6;
  }
  rpc::shutdown();  // B serves until A is done
  if (!ok) std::fprintf(stderr, "FAILED: the weight trained over RPC differs from the reference\n");
  return ok ? 0 : 1;
}
