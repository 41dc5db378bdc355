// tdist-bench pipeline: a pipeline's samples/s and its measured bubble (the stages' idle share
// of a step, from their timelines) next to the analytic (p-1)/(m+p-1) and the schedule's
// simulated bubble, per schedule. Starts --stages processes of itself per schedule (loopback,
// one intra-op thread each); rank 0 prints one line per schedule.
#include <signal.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <sstream>

#include "apps/bench/common.h"
#include "apps/bench/subcommands.h"
#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"
#include "tdist/pipeline/pipeline.h"

namespace tdist::bench {

namespace {

struct Config {
  int stages = 2;
  int microbatches = 8;
  std::string schedules = "gpipe,1f1b,zb";
  int width = 1024;
  int layers = 8;
  int micro_batch_size = 32;
  int warmup = 2;
  int steps = 5;
  std::string worker;  // internal: the schedule this worker process runs
};

int worker_main(const Config& c) {
  torch::set_num_threads(1);
  auto pg = comm::create_process_group("env://");
  const auto kind = pipeline::parse_schedule(c.worker);
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int l = 0; l < c.layers; ++l) {
    model->push_back(torch::nn::Linear(c.width, c.width));
    model->push_back(torch::nn::Tanh());
  }
  const int parts = kind == pipeline::ScheduleKind::kInterleaved1F1B ? 2 * c.stages : c.stages;
  pipeline::PipelineOptions o;
  o.schedule = kind;
  o.microbatches = c.microbatches;
  o.loss_fn = [](const at::Tensor& out, const at::Tensor& y) { return torch::mse_loss(out, y); };
  pipeline::Pipeline pipe(
      pipeline::PipelineStage(model, pipeline::PipelineStage::balanced_bounds(model, parts),
                              pg->rank(), pg->size()),
      pg, o);
  const int64_t batch = static_cast<int64_t>(c.micro_batch_size) * c.microbatches;
  auto x = torch::randn({batch, c.width});
  auto y = torch::randn({batch, c.width});
  pipe.setup(x);
  torch::optim::SGD opt(pipe.stage().parameters(), 0.001);
  double idle = 0, step_us = 0;
  for (int s = 0; s < c.warmup + c.steps; ++s) {
    opt.zero_grad();
    pipe.step(x, y);
    opt.step();
    if (s >= c.warmup) {
      idle += pipe.bubble_fraction();
      const auto& t = pipe.last_timeline();
      step_us += static_cast<double>(t.end_us - t.begin_us);
    }
  }
  // Means over the measured steps and the ranks.
  auto sums = torch::tensor({idle / c.steps, step_us / c.steps}, torch::kFloat64);
  pg->allreduce(sums)->wait();
  if (pg->rank() == 0) {
    const double bubble = sums[0].item<double>() / pg->size();
    const double ms = sums[1].item<double>() / pg->size() / 1000.0;
    std::printf("%-12s p=%d m=%-3d %10.1f samples/s  step %8.1f ms  bubble measured %5.3f  "
                "analytic %5.3f  simulated %5.3f\n",
                c.worker.c_str(), pg->size(), c.microbatches, batch / (ms / 1000.0), ms, bubble,
                pipeline::analytic_bubble(pg->size(), c.microbatches),
                pipe.schedule().simulated_bubble());
    std::fflush(stdout);
  }
  return 0;
}

int run_schedule(const Config& c, const std::string& schedule,
                 const std::vector<std::string>& args) {
  const int port = free_port();
  std::vector<std::string> worker_args{self_exe(), "pipeline", "--worker", schedule};
  worker_args.insert(worker_args.end(), args.begin(), args.end());
  std::vector<pid_t> pids;
  for (int r = 0; r < c.stages; ++r) {
    pids.push_back(spawn_process(worker_args,
                                 {"RANK=" + std::to_string(r),
                                  "WORLD_SIZE=" + std::to_string(c.stages),
                                  "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port),
                                  "OMP_NUM_THREADS=1"},
                                 "rank " + std::to_string(r)));
  }
  int failed = 0;
  for (size_t r = 0; r < pids.size(); ++r) {
    int status = 0;
    ::waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      ++failed;
      for (size_t k = 0; k < pids.size(); ++k) {
        if (k != r) ::kill(pids[k], SIGTERM);
      }
    }
  }
  return failed == 0 ? 0 : 1;
}

}  // namespace

int run_pipeline_bench(int argc, char** argv) {
  Config c;
  CLI::App app{"tdist-bench pipeline: samples/s and measured vs analytic bubble per schedule",
               "pipeline"};
  app.add_option("--stages", c.stages, "pipeline stages (processes)")->check(CLI::Range(1, 64));
  app.add_option("--microbatches", c.microbatches, "microbatches per step")
      ->check(CLI::Range(1, 4096));
  app.add_option("--schedules", c.schedules, "comma-separated: gpipe, 1f1b, interleaved, zb");
  app.add_option("--width", c.width, "features of each Linear layer")->check(CLI::Range(1, 65536));
  app.add_option("--layers", c.layers, "Linear + Tanh blocks")->check(CLI::Range(1, 4096));
  app.add_option("--micro-batch-size", c.micro_batch_size, "samples per microbatch")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--warmup", c.warmup, "steps not measured")->check(CLI::Range(0, 1000));
  app.add_option("--steps", c.steps, "measured steps")->check(CLI::Range(1, 100000));
  app.add_option("--worker", c.worker)->group("");  // internal
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return run_or_report("tdist-bench pipeline", [&] {
    if (!c.worker.empty()) return worker_main(c);
    // The workers get this run's flags again.
    std::vector<std::string> args;
    for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
    std::istringstream names(c.schedules);
    std::string name;
    int rc = 0;
    while (std::getline(names, name, ',')) {
      pipeline::parse_schedule(name);  // InvalidArgument before any process starts
      rc |= run_schedule(c, name, args);
    }
    return rc;
  });
}

}  // namespace tdist::bench
