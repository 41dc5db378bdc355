// tdist-rpc-ddp: DistributedDataParallel and RPC together (PyTorch's "Combining Distributed
// DataParallel with Distributed RPC Framework" tutorial, in C++).
//
//   tdist-run --nproc-per-node 3 tdist-rpc-ddp --steps 60
//
// Rank 0 ("ps") owns an embedding table (an EmbeddingBag). Ranks 1..N ("trainer<r>") each hold a
// replica of the dense part (a Linear) wrapped in ddp::DistributedDataParallel over a process
// group of the trainers only. Each step a trainer, inside a distributed autograd context, looks
// its bags up in the remote table over RPC, runs the dense part and the loss locally, and calls
// autograd::backward once: the embedding's gradient goes back to the ps over RPC, and DDP
// averages the dense gradients across the trainers (its hooks fire under the distributed
// backward too: Note [DDP bucketing] 9 in ddp/reducer.h). One DistributedOptimizer per trainer,
// over the table's parameter RRefs and RRefs of its own dense parameters, then updates both.
//
// After every step the trainers check that their dense parameters agree (max |p - p_trainer1|,
// allreduced with MAX over the trainers' group), print it every --log-every steps, and stop with
// exit code 1 at the first step where it exceeds --tolerance; the first trainer also exits 1 if
// its loss did not fall by half. --no-ddp-sync runs every forward under DDP's no_sync (no
// allreduce): the replicas drift apart and the check fails, which shows it can.
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <cstdio>
#include <optional>

#include "apps/rpc_demos/bags.h"
#include "tdist/autograd/context.h"
#include "tdist/comm/process_group.h"
#include "tdist/core/env.h"
#include "tdist/core/prefix_store.h"
#include "tdist/core/rendezvous.h"
#include "tdist/ddp/distributed_data_parallel.h"
#include "tdist/optim/distributed_optimizer.h"
#include "tdist/rpc/api.h"

namespace rpc = tdist::rpc;
namespace bags = tdist::demo::bags;
namespace dist_autograd = tdist::autograd;

namespace {

constexpr int64_t kEmbed = 16;

struct Options {
  int64_t steps = 60, batch = 32, log_every = 10;
  double lr = 0.01, tolerance = 1e-6;
  bool no_ddp_sync = false;
};

// The ps's table, created on first use (only the ps calls this).
torch::nn::EmbeddingBag& table() {
  static torch::nn::EmbeddingBag t = [] {
    torch::manual_seed(0);
    return torch::nn::EmbeddingBag(
        torch::nn::EmbeddingBagOptions(bags::kVocab, kEmbed).mode(torch::kMean));
  }();
  return t;
}

// Max over the trainers of max |p - p_trainer1| (every trainer gets the same value).
double replica_difference(const std::vector<at::Tensor>& params, tdist::comm::ProcessGroup& pg) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> flat;
  for (const auto& p : params) flat.push_back(p.detach().reshape({-1}));
  at::Tensor mine = at::cat(flat).to(at::kDouble);
  at::Tensor first = mine.clone();
  tdist::comm::BroadcastOptions bopts;
  bopts.root = 0;
  pg.broadcast(first, bopts)->wait();
  at::Tensor diff = (mine - first).abs().max().reshape({1});
  tdist::comm::AllreduceOptions aopts;
  aopts.op = tdist::comm::ReduceOp::MAX;
  pg.allreduce(diff, aopts)->wait();
  return diff.item<double>();
}

int run_trainer(int rank, const Options& o, std::shared_ptr<tdist::comm::ProcessGroup> pg) {
  torch::manual_seed(100 + rank);  // different initial replicas: DDP's broadcast aligns them
  torch::nn::Linear dense(kEmbed, bags::kClasses);
  tdist::ddp::DistributedDataParallel<torch::nn::Linear> model(dense, pg);

  auto params = rpc::rpc_sync<std::vector<rpc::RRef<at::Tensor>>>("ps", "table_parameter_rrefs");
  for (auto& p : tdist::optim::parameter_rrefs(*dense)) params.push_back(std::move(p));
  tdist::optim::DistributedOptimizer opt(
      tdist::optim::OptimizerSpec::adam(torch::optim::AdamOptions(o.lr)), params);

  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + rank);
  double first = 0, last = 0, worst = 0;
  for (int64_t step = 0; step < o.steps; ++step) {
    bags::Batch b = bags::make_batch(o.batch, gen);
    dist_autograd::Context ctx;
    at::Tensor emb = rpc::rpc_sync<at::Tensor>("ps", "table_forward", b.ids, b.offsets);
    at::Tensor logits;
    if (o.no_ddp_sync) {
      auto guard = model.no_sync();
      logits = model(emb);
    } else {
      logits = model(emb);
    }
    at::Tensor loss = torch::cross_entropy_loss(logits, b.labels);
    dist_autograd::backward(ctx.id(), {loss});
    opt.step(ctx.id());

    const double diff = replica_difference(model.parameters(), *pg);
    worst = std::max(worst, diff);
    last = loss.item<double>();
    if (step == 0) first = last;
    if (step % o.log_every == 0 || step + 1 == o.steps || diff > o.tolerance) {
      std::printf("trainer%d step %lld: loss %.4f, dense replicas differ by %.3g\n", rank,
                  static_cast<long long>(step), last, diff);
    }
    if (diff > o.tolerance) {
      std::fprintf(stderr,
                   "trainer%d: the dense parameters differ across trainers after step %lld "
                   "(max |p - p_trainer1| = %.3g > %.3g)\n",
                   rank, static_cast<long long>(step), diff, o.tolerance);
      return 1;  // every trainer sees the same allreduced difference and stops here too
    }
  }
  std::printf(
      "trainer%d: loss %.4f -> %.4f over %lld steps; dense parameters agreed after every "
      "step (max difference %.3g)\n",
      rank, first, last, static_cast<long long>(o.steps), worst);
  return rank == 1 && !(last < 0.5 * first) ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "tdist-rpc-ddp: trainers (ranks 1..N) train a dense part with DDP and a remote "
      "embedding table on rank 0 through RPC, with one distributed backward and one "
      "DistributedOptimizer; start it with tdist-run --nproc-per-node N+1 (N >= 2)"};
  app.add_option("--steps", o.steps, "training steps per trainer");
  app.add_option("--batch", o.batch, "bags per step and trainer");
  app.add_option("--lr", o.lr, "Adam learning rate");
  app.add_option("--log-every", o.log_every, "print the loss and the check every this many steps")
      ->check(CLI::PositiveNumber);
  app.add_option("--tolerance", o.tolerance,
                 "largest difference between the trainers' dense parameters accepted");
  app.add_flag("--no-ddp-sync", o.no_ddp_sync,
               "run every forward under DDP's no_sync (no allreduce; the check must fail)");
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(1);
    rpc::register_function("table_forward", [](at::Tensor ids, at::Tensor offsets) {
      return table()->forward(ids, offsets);
    });
    rpc::register_function("table_parameter_rrefs",
                           [] { return tdist::optim::parameter_rrefs(*table()); });
    const auto env = tdist::env::read_dist_env();
    if (env.world_size < 3) {
      throw tdist::InvalidArgument(
          "tdist-rpc-ddp needs an embedding owner and at least two "
          "trainers (world size 3 or more), got " +
          std::to_string(env.world_size));
    }
    // One rendezvous: RPC uses its store, and the trainers' process group uses the same store
    // under a prefix of its own, with ranks 0..N-1 among the trainers.
    auto rv = tdist::rendezvous("env://", env.rank, env.world_size);
    rpc::RpcOptions ropts;
    ropts.store = rv.store;
    const std::string name = env.rank == 0 ? "ps" : "trainer" + std::to_string(env.rank);
    rpc::init_rpc(name, env.rank, env.world_size, ropts);
    int rc = 0;
    if (env.rank == 0) {
      table();
    } else {
      auto pg = tdist::comm::create_process_group(
          std::make_shared<tdist::PrefixStore>("trainers", rv.store), env.rank - 1,
          env.world_size - 1);
      rc = run_trainer(env.rank, o, pg);
    }
    rpc::shutdown();  // the ps serves until every trainer is done
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-rpc-ddp: %s\n", e.what());
    return 1;
  }
}
