// tdist-rpc-split: a model split across two workers, trained end to end from a third.
//
//   tdist-run --nproc-per-node 3 tdist-rpc-split --steps 60
//
// Rank 1 ("encoder") holds an EmbeddingBag and an encoder layer, rank 2 ("classifier") holds
// the classifier; rank 0 ("trainer") creates both with remote(), owns the data, runs forward
// through both over RPC inside a distributed autograd context, the loss locally, backward across
// all three, and steps a DistributedOptimizer (Adam) over both remote modules' parameters.
// The bags of token ids are the task of apps/rpc_demos/bags.h, so the loss falls; the trainer
// prints the first and last loss and exits 1 if it did not fall by half.
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <cstdio>

#include "apps/rpc_demos/bags.h"
#include "tdist/autograd/context.h"
#include "tdist/core/env.h"
#include "tdist/optim/distributed_optimizer.h"
#include "tdist/rpc/api.h"

namespace rpc = tdist::rpc;
namespace demo = tdist::demo;
namespace dist_autograd = tdist::autograd;

namespace {

using demo::bags::kClasses;
using demo::bags::kVocab;
constexpr int64_t kEmbed = 16, kHidden = 32;

class Encoder {
 public:
  explicit Encoder(int64_t seed) {
    torch::manual_seed(seed);
    bag_ =
        torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(kVocab, kEmbed).mode(torch::kMean));
    fc_ = torch::nn::Linear(kEmbed, kHidden);
    module_.register_module("bag", bag_);
    module_.register_module("fc", fc_);
  }
  at::Tensor forward(at::Tensor ids, at::Tensor offsets) {
    return torch::relu(fc_->forward(bag_->forward(ids, offsets)));
  }
  std::vector<rpc::RRef<at::Tensor>> parameter_rrefs() {
    return tdist::optim::parameter_rrefs(module_);
  }

 private:
  torch::nn::Module module_;
  torch::nn::EmbeddingBag bag_{nullptr};
  torch::nn::Linear fc_{nullptr};
};

class Classifier {
 public:
  explicit Classifier(int64_t seed) {
    torch::manual_seed(seed);
    fc_ = torch::nn::Linear(kHidden, kClasses);
  }
  at::Tensor forward(at::Tensor h) { return fc_->forward(h); }
  std::vector<rpc::RRef<at::Tensor>> parameter_rrefs() {
    return tdist::optim::parameter_rrefs(*fc_);
  }

 private:
  torch::nn::Linear fc_{nullptr};
};

}  // namespace

int main(int argc, char** argv) {
  int64_t steps = 60, batch = 32;
  double lr = 0.01;
  CLI::App app{
      "tdist-rpc-split: a model split across two workers (embedding bag + encoder, "
      "classifier) trained end to end from a third; start it with tdist-run "
      "--nproc-per-node 3"};
  app.add_option("--steps", steps, "training steps");
  app.add_option("--batch", batch, "bags per step");
  app.add_option("--lr", lr, "Adam learning rate");
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(1);
    rpc::register_class<Encoder>("Encoder")
        .constructor<int64_t>()
        .method("forward", &Encoder::forward)
        .method("parameter_rrefs", &Encoder::parameter_rrefs);
    rpc::register_class<Classifier>("Classifier")
        .constructor<int64_t>()
        .method("forward", &Classifier::forward)
        .method("parameter_rrefs", &Classifier::parameter_rrefs);
    const auto env = tdist::env::read_dist_env();
    if (env.world_size != 3) {
      throw tdist::InvalidArgument("tdist-rpc-split runs on exactly 3 workers");
    }
    const char* names[] = {"trainer", "encoder", "classifier"};
    rpc::init_rpc(names[env.rank], env.rank, env.world_size);
    int rc = 0;
    if (env.rank == 0) {
      auto encoder = rpc::remote<Encoder>("encoder", "Encoder", int64_t{1});
      auto classifier = rpc::remote<Classifier>("classifier", "Classifier", int64_t{2});
      auto params = encoder.rpc_sync<std::vector<rpc::RRef<at::Tensor>>>("parameter_rrefs");
      for (auto& p : classifier.rpc_sync<std::vector<rpc::RRef<at::Tensor>>>("parameter_rrefs")) {
        params.push_back(p);
      }
      tdist::optim::DistributedOptimizer opt(
          tdist::optim::OptimizerSpec::adam(torch::optim::AdamOptions(lr)), params);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
      double first = 0, last = 0;
      for (int64_t step = 0; step < steps; ++step) {
        demo::bags::Batch b = demo::bags::make_batch(batch, gen);
        dist_autograd::Context ctx;
        at::Tensor h = encoder.rpc_sync<at::Tensor>("forward", b.ids, b.offsets);
        at::Tensor logits = classifier.rpc_sync<at::Tensor>("forward", h);
        at::Tensor loss = torch::cross_entropy_loss(logits, b.labels);
        dist_autograd::backward(ctx.id(), {loss});
        opt.step(ctx.id());
        const double l = loss.item<double>();
        if (step == 0) first = l;
        last = l;
        if (step % 10 == 0) std::printf("step %lld: loss %.4f\n", static_cast<long long>(step), l);
      }
      std::printf("loss %.4f -> %.4f over %lld steps\n", first, last,
                  static_cast<long long>(steps));
      if (!(last < 0.5 * first)) rc = 1;
    }
    rpc::shutdown();
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-rpc-split: %s\n", e.what());
    return 1;
  }
}
