// tdist-bench rpc --autograd: the cost of RPC and distributed autograd, as the time of one
// training iteration run across two workers against the same iteration run locally in one
// process (issue 46: the overhead at most 5% of the local time). Two workers on this machine
// (this process trains as worker0, a copy of it started as worker1 holds the remote part):
//   seed   demo 1's shape: a Linear 2 -> 1 (no bias) on worker1, 8 samples on worker0, MSE loss,
//          SGD (lr 0.05); almost no computation, so its row shows the overhead itself
//   split  an MLP 784-1024-1024-1024-10 split in two: 784->1024->1024 (ReLU) on worker1,
//          1024->1024->10 on worker0 (the trainer), batch 64, cross entropy, SGD (lr 0.01)
// A distributed iteration: a context, forward over RPC, the loss, distributed backward,
// DistributedOptimizer::step. The local one, in this process with the same models (same seeds),
// batch and thread count: forward, the loss, backward, a libtorch SGD step (zero_grad first).
// Rounds alternate distributed and local; medians of the rounds. With --torch each round also
// runs torch.distributed.autograd + its DistributedOptimizer (scripts/bench_autograd_torch.py),
// shown beside, without a target.
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "apps/bench/subcommands.h"
#include "apps/bench/two_workers.h"
#include "tdist/autograd/context.h"
#include "tdist/optim/distributed_optimizer.h"
#include "tdist/rpc/api.h"

namespace tdist::bench {
namespace autograd_bench {  // see collective.cpp
namespace {

using json = nlohmann::json;
namespace dist_autograd = tdist::autograd;

struct Options {
  int iters = 200;
  int warmup = 20;
  int split_iters = 50;
  int split_warmup = 5;
  int threads = 4;
  int rounds = 5;
  bool torch = false;
  std::string torch_script;
  std::string json_file;
  bool server = false;  // internal: the worker1 role
  int store_port = 0;
};

// Demo 1's Net: one linear layer 2 -> 1, no bias.
class SeedNet {
 public:
  explicit SeedNet(int64_t seed) {
    torch::manual_seed(seed);
    fc_ = torch::nn::Linear(torch::nn::LinearOptions(2, 1).bias(false));
  }
  at::Tensor forward(at::Tensor x) { return fc_->forward(x); }
  std::vector<rpc::RRef<at::Tensor>> parameter_rrefs() {
    return tdist::optim::parameter_rrefs(*fc_);
  }
  std::vector<at::Tensor> parameters() const { return fc_->parameters(); }

 private:
  torch::nn::Linear fc_{nullptr};
};

// The first half of the split MLP (784 -> 1024 -> 1024, ReLU after each).
class FrontMlp {
 public:
  explicit FrontMlp(int64_t seed) {
    torch::manual_seed(seed);
    seq_ = torch::nn::Sequential(torch::nn::Linear(784, 1024), torch::nn::ReLU(),
                                 torch::nn::Linear(1024, 1024), torch::nn::ReLU());
  }
  at::Tensor forward(at::Tensor x) { return seq_->forward(x); }
  std::vector<rpc::RRef<at::Tensor>> parameter_rrefs() {
    return tdist::optim::parameter_rrefs(*seq_);
  }
  std::vector<at::Tensor> parameters() const { return seq_->parameters(); }

 private:
  torch::nn::Sequential seq_{nullptr};
};

void register_classes() {
  rpc::register_class<SeedNet>("BenchSeedNet")
      .constructor<int64_t>()
      .method("forward", &SeedNet::forward)
      .method("parameter_rrefs", &SeedNet::parameter_rrefs);
  rpc::register_class<FrontMlp>("BenchFrontMlp")
      .constructor<int64_t>()
      .method("forward", &FrontMlp::forward)
      .method("parameter_rrefs", &FrontMlp::parameter_rrefs);
}

// Runs `step` warmup + iters times; the median time of one iteration in milliseconds.
template <class Step>
double time_iterations(int warmup, int iters, Step&& step) {
  return median(time_calls(warmup, std::max(iters, 1), [&](int) { step(); })) * 1e3;
}

// The trainer's half of the split MLP (1024 -> 1024, ReLU, -> 10).
torch::nn::Sequential back_mlp() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(1024, 1024), torch::nn::ReLU(),
                               torch::nn::Linear(1024, 10));
}

// The batches of both shapes, the same in the distributed and the local runs.
struct Batches {
  Batches() {
    torch::manual_seed(4);
    seed_x = at::randn({8, 2});
    seed_y = at::randn({8, 1});
    split_x = at::randn({64, 784});
    split_y = at::randint(10, {64}, at::kLong);
  }
  at::Tensor seed_x, seed_y, split_x, split_y;
};

json measure(const Options& o) {
  rpc::init_rpc("worker0", 0, 2, worker_options(o.store_port, o.threads));
  json r;
  r["backend"] = "tdist";
  {
    auto net = rpc::remote<SeedNet>("worker1", "BenchSeedNet", int64_t{1});
    optim::DistributedOptimizer opt(
        optim::OptimizerSpec::sgd(torch::optim::SGDOptions(0.05)),
        net.rpc_sync<std::vector<rpc::RRef<at::Tensor>>>("parameter_rrefs"));
    const Batches b;
    const at::Tensor &x = b.seed_x, &y = b.seed_y;
    double loss = 0;
    r["seed_ms"] = time_iterations(o.warmup, o.iters, [&] {
      dist_autograd::Context ctx;
      at::Tensor l = torch::mse_loss(net.rpc_sync<at::Tensor>("forward", x), y);
      dist_autograd::backward(ctx.id(), {l});
      opt.step(ctx.id());
      loss = l.item<double>();
    });
    r["seed_final_loss"] = loss;
  }
  {
    auto front = rpc::remote<FrontMlp>("worker1", "BenchFrontMlp", int64_t{2});
    torch::nn::Sequential back = back_mlp();
    auto params = front.rpc_sync<std::vector<rpc::RRef<at::Tensor>>>("parameter_rrefs");
    for (auto& p : tdist::optim::parameter_rrefs(*back)) params.push_back(p);
    optim::DistributedOptimizer opt(optim::OptimizerSpec::sgd(torch::optim::SGDOptions(0.01)),
                                    params);
    const Batches b;
    const at::Tensor &x = b.split_x, &y = b.split_y;
    double loss = 0;
    r["split_ms"] = time_iterations(o.split_warmup, o.split_iters, [&] {
      dist_autograd::Context ctx;
      at::Tensor h = front.rpc_sync<at::Tensor>("forward", x);
      at::Tensor l = torch::cross_entropy_loss(back->forward(h), y);
      dist_autograd::backward(ctx.id(), {l});
      opt.step(ctx.id());
      loss = l.item<double>();
    });
    r["split_final_loss"] = loss;
  }
  rpc::shutdown();
  return r;
}

// The same iterations in this process: the anchor.
json measure_local(const Options& o) {
  json r;
  r["backend"] = "local";
  const Batches b;
  {
    SeedNet net(1);
    torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.05));
    double loss = 0;
    r["seed_ms"] = time_iterations(o.warmup, o.iters, [&] {
      opt.zero_grad();
      at::Tensor l = torch::mse_loss(net.forward(b.seed_x), b.seed_y);
      l.backward();
      opt.step();
      loss = l.item<double>();
    });
    r["seed_final_loss"] = loss;
  }
  {
    FrontMlp front(2);
    torch::nn::Sequential back = back_mlp();
    std::vector<at::Tensor> params = front.parameters();
    for (const auto& p : back->parameters()) params.push_back(p);
    torch::optim::SGD opt(params, torch::optim::SGDOptions(0.01));
    double loss = 0;
    r["split_ms"] = time_iterations(o.split_warmup, o.split_iters, [&] {
      opt.zero_grad();
      at::Tensor l = torch::cross_entropy_loss(back->forward(front.forward(b.split_x)), b.split_y);
      l.backward();
      opt.step();
      loss = l.item<double>();
    });
    r["split_final_loss"] = loss;
  }
  return r;
}

int run_server(const Options& o) {
  rpc::init_rpc("worker1", 1, 2, worker_options(o.store_port, o.threads));
  rpc::shutdown();  // serves until worker0 is done too
  return 0;
}

pid_t start_server(const Options& o) {
  return spawn_server({"--autograd"}, o.store_port, o.threads);
}

json run_torch(const Options& o) {
  std::ostringstream args;
  args << " --iters " << o.iters << " --warmup " << o.warmup << " --split-iters " << o.split_iters
       << " --split-warmup " << o.split_warmup << " --threads " << o.threads;
  return run_torch_script(o.torch_script, args.str());
}

}  // namespace
}  // namespace autograd_bench

int run_autograd_bench(int argc, char** argv) {
  using namespace autograd_bench;
  Options o;
  bool autograd = false, no_torch = false;
  CLI::App app{
      "tdist-bench rpc --autograd: per-iteration time of training over RPC with distributed "
      "autograd + DistributedOptimizer (two workers on this machine) against the same "
      "iteration run locally in one process"};
  app.add_flag("--autograd", autograd, "this benchmark (instead of the plain RPC one)");
  app.add_option("--iters", o.iters, "timed iterations of demo 1's shape (Linear 2->1)");
  app.add_option("--warmup", o.warmup, "untimed iterations before them");
  app.add_option("--split-iters", o.split_iters, "timed iterations of the split MLP");
  app.add_option("--split-warmup", o.split_warmup, "untimed iterations before them");
  app.add_option("--threads", o.threads, "RPC worker threads per worker (both sides)");
  app.add_option("--rounds", o.rounds, "alternate distributed and local this many times; medians");
  app.add_flag("--torch", o.torch,
               "also run torch.distributed.autograd each round (shown beside, no target)");
  app.add_flag("--no-torch", no_torch, "(the default) no torch.distributed.autograd side");
  app.add_option("--torch-script", o.torch_script, "path of scripts/bench_autograd_torch.py");
  app.add_option("--json", o.json_file, "also write the results as JSON to this file");
  app.add_flag("--role-server", o.server)->group("");
  app.add_option("--store-port", o.store_port)->group("");
  CLI11_PARSE(app, argc, argv);
  o.torch = o.torch && !no_torch;

  return run_or_report("tdist-bench rpc --autograd", [&] {
    at::set_num_threads(1);
    register_classes();
    if (o.server) return run_server(o);
    if (o.torch && o.torch_script.empty()) o.torch_script = find_script("bench_autograd_torch.py");
    std::vector<json> ours, local, theirs;
    run_rounds(
        o, start_server, measure,
        [&](Options& opts) {
          local.push_back(measure_local(opts));
          if (opts.torch) theirs.push_back(run_torch(opts));
        },
        ours);
    auto med = [](const std::vector<json>& runs) {
      return median_of(runs, {"seed_ms", "split_ms"});
    };
    json a = med(ours), l = med(local), result{{"tdist", a}, {"local", l}};
    // The overhead per iteration: what the distributed iteration costs beyond the local one.
    for (const char* key : {"seed_ms", "split_ms"}) {
      result["overhead_ms"][key] = a[key].get<double>() - l[key].get<double>();
    }

    // The two shapes against an anchor; only the split MLP has a target.
    auto ratio_table = [](const char* title, const char* anchor, double split_target) {
      return RatioTable{
          title,
          anchor,
          44,
          10,
          3,
          8,
          7,
          {{"seed: Linear 2->1 remote, 8 samples, SGD", "seed_ms", true, RatioTable::kNoTarget},
           {"split MLP 784-1024x3-10, batch 64, SGD", "split_ms", true, split_target}}};
    };
    constexpr double kTarget = 1.05;  // RPC and autograd at most 5% over the local computation
    const bool all_met =
        print_ratio_table(ratio_table("per iteration (ms)", "local", kTarget), a, &l, result);
    std::printf("overhead per iteration: seed %.1f us, split MLP %.1f us\n",
                result["overhead_ms"]["seed_ms"].get<double>() * 1e3,
                result["overhead_ms"]["split_ms"].get<double>() * 1e3);
    if (o.torch) {
      json b = med(theirs);
      result["torch"] = b;
      json against_torch;
      print_ratio_table(
          ratio_table("against torch.distributed.autograd (ms)", "torch", RatioTable::kNoTarget), a,
          &b, against_torch);
      result["torch_ratios"] = against_torch["ratios"];
    }
    std::printf(
        "(medians of %d alternating rounds, each the median of %d / %d timed iterations; "
        "%d RPC worker threads, 1 intra-op thread; the seed shape has no target: it is almost "
        "all overhead)\n",
        std::max(o.rounds, 1), o.iters, o.split_iters, o.threads);
    finish_report(o.json_file, result, true, all_met);
    return 0;
  });
}

}  // namespace tdist::bench
