// tdist-rpc-ps-autograd: a parameter server with several trainers using distributed autograd and
// the DistributedOptimizer (the shape of PyTorch's parameter-server RPC tutorial), on the data and
// model of tdist-train.
//
//   tdist-run --nproc-per-node 3 tdist-rpc-ps-autograd --dataset fashion-mnist --steps 150
//
// Rank 0 ("ps") holds the model, tdist-train's MLP (apps/train/models.h), initialised as
// tdist-train initialises it for the same --seed. Ranks 1..N ("trainer<r>") each read the training
// set with tdist-train's reader (apps/train/data.h: synthetic, MNIST or Fashion-MNIST), take their
// shard of it as tdist-train's DistributedSampler gives it, and each step run the model's forward
// on the server over RPC inside a distributed autograd context, compute the loss locally, run
// distributed backward and step their DistributedOptimizer (SGD), which applies the gradients on
// the server. Trainers run concurrently, without waiting for each other (asynchronous SGD). When
// all are done the server prints the model's accuracy on the test set and exits 1 if it is below
// --min-accuracy.
//
// Parameters updated in place between a forward and its backward. While one trainer is between its
// forward and its backward, another trainer's optimizer step updates the parameters in place. A
// Linear's backward needs its weight (the gradient of its input is grad_out @ W), so a forward that
// used the parameters themselves would compute its backward with weights other than those of its
// forward: silently, since libtorch's optimizers update through p.data(), which autograd's version
// check does not see (an update through p itself fails that backward with "a variable needed for
// gradient computation has been modified by an inplace operation"). The server's forward therefore
// uses a snapshot of each parameter, taken under autograd when the forward starts (p.clone()):
// clone's backward saves nothing and passes the gradient straight on to p, so the gradient still
// accumulates for p in the trainer's context, while the graph saved for backward holds only the
// snapshot, which nothing modifies. This is asynchronous ("Hogwild") SGD as in PyTorch's tutorial:
// each gradient is exact for the weights its forward saw, and it is applied to the weights as they
// are when it arrives. The snapshot is read without a lock, so it may catch another trainer's step
// half applied; asynchronous SGD tolerates that as it tolerates stale weights. The cost is one copy
// of the parameters per forward.
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <cstdio>

#include "apps/train/data.h"
#include "apps/train/models.h"
#include "tdist/autograd/context.h"
#include "tdist/core/env.h"
#include "tdist/optim/distributed_optimizer.h"
#include "tdist/rpc/api.h"

namespace rpc = tdist::rpc;
namespace train = tdist::train;
namespace dist_autograd = tdist::autograd;

namespace {

struct Options {
  train::DataConfig data;
  train::ModelConfig model;
  int64_t steps = 150, batch = 32;
  double lr = 0.05, momentum = 0.9, min_accuracy = 0.0;
  uint64_t seed = 0;
};

// Set by main() before RPC starts; read-only afterwards.
Options g_options;

// The server's model, created on first use (only the server calls this): tdist-train's model
// for the same seed.
torch::nn::Sequential& server_model() {
  static torch::nn::Sequential model = [] {
    torch::manual_seed(g_options.seed);
    return train::build_model(g_options.model);
  }();
  return model;
}

// The MLP's forward on snapshots of its parameters (see the file comment).
at::Tensor snapshot_forward(torch::nn::Sequential& model, at::Tensor x) {
  for (const auto& m : *model) {
    if (auto* linear = m.ptr()->as<torch::nn::LinearImpl>()) {
      x = torch::linear(x, linear->weight.clone(), linear->bias.clone());
    } else if (m.ptr()->as<torch::nn::ReLUImpl>() != nullptr) {
      x = torch::relu(x);
    } else if (m.ptr()->as<torch::nn::FlattenImpl>() != nullptr) {
      x = x.flatten(1);
    } else {
      throw tdist::InvalidArgument("snapshot_forward: unexpected layer " + m.ptr()->name());
    }
  }
  return x;
}

int run_trainer(int rank, int trainers) {
  const Options& o = g_options;
  train::DataSplits data = train::load_data(o.data);
  auto params = rpc::rpc_sync<std::vector<rpc::RRef<at::Tensor>>>("ps", "ps_parameter_rrefs");
  tdist::optim::DistributedOptimizer opt(
      tdist::optim::OptimizerSpec::sgd(torch::optim::SGDOptions(o.lr).momentum(o.momentum)),
      params);
  train::DistributedSampler sampler(data.train->size(), trainers, rank - 1, /*shuffle=*/true,
                                    o.seed);
  int64_t epoch = 0;
  int64_t position = 0;
  std::vector<int64_t> order = sampler.epoch_order(epoch);
  double first = 0, last = 0;
  for (int64_t step = 0; step < o.steps; ++step) {
    if (sampler.steps_left(position, o.batch) == 0) {
      order = sampler.epoch_order(++epoch);
      position = 0;
    }
    train::Batch b = data.train->get(sampler.step_indices(order, position, o.batch));
    position += o.batch * trainers;
    dist_autograd::Context ctx;
    at::Tensor logits = rpc::rpc_sync<at::Tensor>("ps", "ps_forward", b.images);
    at::Tensor loss = torch::cross_entropy_loss(logits, b.labels);
    dist_autograd::backward(ctx.id(), {loss});
    opt.step(ctx.id());
    last = loss.item<double>();
    if (step == 0) first = last;
  }
  std::printf("trainer%d: loss %.4f -> %.4f over %lld steps\n", rank, first, last,
              static_cast<long long>(o.steps));
  return 0;
}

// Accuracy of the server's model on `test`.
double server_accuracy(const train::Dataset& test) {
  torch::NoGradGuard no_grad;
  server_model()->eval();
  int64_t correct = 0;
  for (int64_t begin = 0; begin < test.size(); begin += 1000) {
    std::vector<int64_t> idx;
    for (int64_t i = begin; i < std::min(test.size(), begin + 1000); ++i) idx.push_back(i);
    train::Batch b = test.get(idx);
    correct += server_model()->forward(b.images).argmax(1).eq(b.labels).sum().item<int64_t>();
  }
  return static_cast<double>(correct) / static_cast<double>(test.size());
}

}  // namespace

int main(int argc, char** argv) {
  Options& o = g_options;
  o.data.train_samples = 60000;
  o.data.test_samples = 2000;
  CLI::App app{
      "tdist-rpc-ps-autograd: a parameter server (rank 0) and trainers (ranks 1..N) "
      "training tdist-train's MLP with distributed autograd and the "
      "DistributedOptimizer; start it with tdist-run --nproc-per-node N+1"};
  app.add_option("--dataset", o.data.dataset, "synthetic, mnist or fashion-mnist (as tdist-train)")
      ->check(CLI::IsMember({"synthetic", "mnist", "fashion-mnist"}));
  app.add_option(
      "--data-dir", o.data.data_dir,
      "mnist: the IDX files; fashion-mnist: default " + std::string(train::kFashionMnistDir));
  app.add_option("--train-samples", o.data.train_samples, "training samples (a limit for files)");
  app.add_option("--test-samples", o.data.test_samples, "test samples the server evaluates");
  app.add_option("--signal", o.data.signal, "synthetic: strength of the class pattern");
  app.add_option("--hidden", o.model.hidden, "MLP hidden width");
  app.add_option("--layers", o.model.layers, "MLP hidden layers");
  app.add_option("--steps", o.steps, "training steps per trainer");
  app.add_option("--batch", o.batch, "samples per step");
  app.add_option("--lr", o.lr, "SGD learning rate");
  app.add_option("--momentum", o.momentum, "SGD momentum");
  app.add_option("--seed", o.seed, "seed of the model and the data order (as tdist-train's)");
  app.add_option("--min-accuracy", o.min_accuracy, "exit 1 when the final accuracy is below this");
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(1);
    o.data.seed = o.seed;
    rpc::register_function("ps_forward",
                           [](at::Tensor x) { return snapshot_forward(server_model(), x); });
    rpc::register_function("ps_parameter_rrefs",
                           [] { return tdist::optim::parameter_rrefs(*server_model()); });
    const auto env = tdist::env::read_dist_env();
    if (env.world_size < 2) {
      throw tdist::InvalidArgument("tdist-rpc-ps-autograd needs a server and at least one trainer");
    }
    const std::string name = env.rank == 0 ? "ps" : "trainer" + std::to_string(env.rank);
    rpc::init_rpc(name, env.rank, env.world_size);
    int rc = 0;
    if (env.rank == 0) {
      train::DataSplits data = train::load_data(o.data);
      std::printf("ps: model %s, %s\n", train::describe_model(o.model).c_str(),
                  data.description.c_str());
      const auto& test = data.test;
      server_model();
      rpc::shutdown();  // serves until every trainer is done
      const int64_t trainers = env.world_size - 1;
      const double acc = server_accuracy(*test);
      std::printf(
          "ps: test accuracy %.4f on %lld test samples after %lld trainers x %lld steps "
          "of %lld (%lld samples)\n",
          acc, static_cast<long long>(test->size()), static_cast<long long>(trainers),
          static_cast<long long>(o.steps), static_cast<long long>(o.batch),
          static_cast<long long>(trainers * o.steps * o.batch));
      if (!(acc >= o.min_accuracy)) rc = 1;
    } else {
      rc = run_trainer(env.rank, env.world_size - 1);
      rpc::shutdown();
    }
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-rpc-ps-autograd: %s\n", e.what());
    return 1;
  }
}
