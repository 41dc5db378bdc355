// tdist-rpc-ps: a parameter server over tdist RPC (asynchronous SGD).
//
//   tdist-run --standalone --nproc-per-node 3 tdist-rpc-ps --steps 300
//
// Rank 0 owns a ParameterServer (a weight vector behind a mutex) and hands an RRef to it to every
// other rank. Each trainer repeats: pull the weights (a method call on the owner), compute the
// gradient of a least-squares loss on its own synthetic batch, push the gradient (the owner
// applies it at once). All trainers fit the same hidden weights, so the loss falls everywhere.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <mutex>

#include "tdist/core/env.h"
#include "tdist/rpc/api.h"

namespace rpc = tdist::rpc;

namespace {

class ParameterServer {
 public:
  ParameterServer(int64_t dim, double lr) : weights_(at::zeros({dim})), lr_(lr) {}
  at::Tensor pull() {
    std::lock_guard<std::mutex> lock(mu_);
    return weights_.clone();
  }
  int64_t push(at::Tensor grad) {
    std::lock_guard<std::mutex> lock(mu_);
    weights_.sub_(grad, lr_);
    return ++updates_;
  }

 private:
  std::mutex mu_;
  at::Tensor weights_;
  double lr_;
  int64_t updates_ = 0;
};

// The hidden weights every trainer's data comes from.
at::Tensor true_weights(int64_t dim) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  return at::randn({dim}, gen);
}

// Runs on a trainer: `steps` rounds of pull, gradient, push. Returns {first loss, last loss}.
std::pair<double, double> run_trainer(rpc::RRef<ParameterServer> ps, int64_t steps, int64_t batch,
                                      int64_t seed) {
  const int64_t dim = ps.rpc_sync<at::Tensor>("pull").numel();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor w_true = true_weights(dim);
  double first = 0, last = 0;
  for (int64_t step = 0; step < steps; ++step) {
    at::Tensor x = at::randn({batch, dim}, gen);
    at::Tensor y = at::matmul(x, w_true) + 0.01 * at::randn({batch}, gen);
    at::Tensor w = ps.rpc_sync<at::Tensor>("pull");
    at::Tensor err = at::matmul(x, w) - y;
    const double loss = err.pow(2).mean().item<double>();
    if (step == 0) first = loss;
    last = loss;
    at::Tensor grad = 2.0 / static_cast<double>(batch) * at::matmul(x.t(), err);
    ps.rpc_sync<int64_t>("push", grad);
  }
  return {first, last};
}

}  // namespace

int main(int argc, char** argv) {
  int64_t steps = 200, dim = 64, batch = 32;
  double lr = 0.02;
  CLI::App app{
      "tdist-rpc-ps: asynchronous SGD with a parameter server over tdist RPC "
      "(rank 0 serves, the other ranks train); start it with tdist-run"};
  app.add_option("--steps", steps, "steps per trainer");
  app.add_option("--dim", dim, "number of weights");
  app.add_option("--batch", batch, "samples per step");
  app.add_option("--lr", lr, "learning rate");
  CLI11_PARSE(app, argc, argv);

  try {
    at::set_num_threads(1);
    rpc::register_class<ParameterServer>("ParameterServer")
        .constructor<int64_t, double>()
        .method("pull", &ParameterServer::pull)
        .method("push", &ParameterServer::push);
    rpc::register_function("run_trainer", &run_trainer);

    const auto env = tdist::env::read_dist_env();
    if (env.world_size < 2) {
      std::fprintf(stderr, "tdist-rpc-ps needs at least 2 ranks (one server, one trainer)\n");
      return 2;
    }
    const std::string name = env.rank == 0 ? "ps" : "trainer" + std::to_string(env.rank);
    rpc::init_rpc(name, env.rank, env.world_size);
    int rc = 0;
    if (env.rank == 0) {
      // remote() to ourselves: the server is built in place on this worker, which owns it.
      auto ps = rpc::remote<ParameterServer>("ps", "ParameterServer", dim, lr);
      std::vector<rpc::Future<std::pair<double, double>>> trainers;
      for (int r = 1; r < env.world_size; ++r) {
        trainers.push_back(rpc::rpc_async<std::pair<double, double>>(r, "run_trainer", ps, steps,
                                                                     batch, int64_t{r}));
      }
      for (int r = 1; r < env.world_size; ++r) {
        auto [first, last] = trainers[r - 1].value();
        std::printf("trainer%d: loss %.4f -> %.6f\n", r, first, last);
        if (!(last < first)) rc = 1;
      }
      const double dist = (ps.local_value()->pull() - true_weights(dim)).abs().max().item<double>();
      std::printf("max |w - w_true| = %.5f after %lld updates\n", dist,
                  static_cast<long long>(steps * (env.world_size - 1)));
    }
    rpc::shutdown();
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-rpc-ps: %s\n", e.what());
    return 1;
  }
}
