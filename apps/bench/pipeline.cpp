// tdist-bench pipeline: a pipeline's samples/s (wall time of the measured steps, optimizer step
// included, as the anchor measures itself) and its measured bubble (the stages' idle share of
// each step's makespan, from their timelines: pipeline_bubble in timeline.h) next to the analytic (p-1)/(m+p-1) and the schedule's
// simulated bubble, per schedule; beside it, PyTorch's torch.distributed.pipelining over gloo on
// the same model, cut, schedule and microbatches (scripts/bench_pipeline_torch.py), and the
// ratio of the two. Starts --stages processes of itself per schedule and round (loopback, one
// intra-op thread each); rank 0 writes its figures to a file the parent reads and prints.
// Models: --model mlp (Linear + Tanh layers, MSE against random targets) or gpt (tdist-train's
// byte-level GPT cut at its layers(): embedding, blocks, head; cross-entropy on random bytes).
#include <signal.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "apps/bench/common.h"
#include "apps/bench/subcommands.h"
#include "apps/train/models.h"
#include "tdist/comm/process_group.h"
#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/pipeline/pipeline.h"

namespace tdist::bench {

namespace pipeline_bench {  // see collective.cpp
namespace {

struct Config {
  int stages = 2;
  int microbatches = 8;
  std::string schedules = "gpipe,1f1b,zb";
  std::string model = "mlp";  // or "gpt"
  int width = 1024;           // gpt: 256 unless given
  int layers = 8;             // gpt: blocks, 4 unless given
  int heads = 4;              // gpt only
  int context = 128;          // gpt only: bytes per sample
  int micro_batch_size = 32;  // gpt: 4 unless given
  int warmup = 2;
  int steps = 5;
  int rounds = 1;
  bool compare_torch = true;
  std::string python = "python3";
  std::string torch_script;  // --torch-script; empty: find_script("bench_pipeline_torch.py")
  std::string json_file;
  std::string worker;  // internal: the schedule this worker process runs
};

// What one run of a schedule measured (rank 0's means over the measured steps and the ranks).
struct Figures {
  double samples_per_s = 0;
  double step_ms = 0;
  double bubble = 0;    // tdist only: the measured bubble (timeline.h, pipeline_bubble)
  double own_idle = 0;  // tdist only: the ranks' mean idle share of their own step() calls
};

bool is_gpt(const Config& c) { return c.model == "gpt"; }

train::ModelConfig gpt_config(const Config& c) {
  train::ModelConfig m;
  m.kind = "gpt";
  m.layers = c.layers;
  m.width = c.width;
  m.heads = c.heads;
  m.context = c.context;
  return m;
}

torch::nn::Sequential make_model(const Config& c) {
  torch::manual_seed(0);
  if (is_gpt(c)) return train::build_train_model(gpt_config(c))->layers();
  torch::nn::Sequential model;
  for (int l = 0; l < c.layers; ++l) {
    model->push_back(torch::nn::Linear(c.width, c.width));
    model->push_back(torch::nn::Tanh());
  }
  return model;
}

// The layer bounds of the run (both implementations cut the model there).
std::vector<int64_t> bounds_of(const Config& c, pipeline::ScheduleKind kind) {
  const int parts = kind == pipeline::ScheduleKind::kInterleaved1F1B ? 2 * c.stages : c.stages;
  return pipeline::PipelineStage::balanced_bounds(make_model(c), parts);
}

int worker_main(const Config& c) {
  torch::set_num_threads(1);
  auto pg = comm::create_process_group("env://");
  const auto kind = pipeline::parse_schedule(c.worker);
  auto model = make_model(c);
  pipeline::PipelineOptions o;
  o.schedule = kind;
  o.microbatches = c.microbatches;
  if (is_gpt(c)) {
    o.loss_fn = [](const at::Tensor& out, const at::Tensor& y) { return train::loss_of(out, y); };
  } else {
    o.loss_fn = [](const at::Tensor& out, const at::Tensor& y) { return torch::mse_loss(out, y); };
  }
  pipeline::Pipeline pipe(
      pipeline::PipelineStage(model, bounds_of(c, kind), pg->rank(), pg->size()), pg, o);
  const int64_t batch = static_cast<int64_t>(c.micro_batch_size) * c.microbatches;
  auto sample = [&] {  // inputs, then targets: random bytes (gpt) or values (mlp)
    return is_gpt(c) ? torch::randint(train::kVocabSize, {batch, c.context}, torch::kLong)
                     : torch::randn({batch, c.width});
  };
  auto x = sample();
  auto y = sample();
  pipe.setup(x);
  torch::optim::SGD opt(pipe.stage().parameters(), 0.001);
  // The bubble per step (timeline.h, pipeline_bubble): every rank's compute over the step's
  // makespan, from the first compute event on any rank to the last one's end; the ranks are
  // processes of this host, so their steady clocks agree. Gathered after the timed steps.
  auto step_once = [&] {
    opt.zero_grad();
    pipe.step(x, y);
    opt.step();
  };
  for (int s = 0; s < c.warmup; ++s) step_once();
  comm::BarrierOptions bo;
  pg->barrier(bo)->wait();
  // Timed as the anchor times itself: wall time of the measured steps, optimizer included,
  // between barriers.
  const auto start = std::chrono::steady_clock::now();
  // Per step: compute (summed), -first compute begin and last compute end (both by MAX).
  auto compute = torch::zeros({c.steps}, torch::kFloat64);
  auto span = torch::zeros({c.steps, 2}, torch::kFloat64);
  double own_idle = 0;
  for (int s = 0; s < c.steps; ++s) {
    step_once();
    const auto& t = pipe.last_timeline();
    own_idle += t.idle_fraction();
    compute[s] = static_cast<double>(t.compute_us());
    span[s][0] = -static_cast<double>(t.compute_begin_us());
    span[s][1] = static_cast<double>(t.compute_end_us());
  }
  pg->barrier(bo)->wait();
  const double total_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  auto idle = torch::tensor({own_idle / c.steps}, torch::kFloat64);
  pg->allreduce(idle)->wait();
  pg->allreduce(compute)->wait();
  comm::AllreduceOptions mx;
  mx.op = comm::ReduceOp::MAX;
  pg->allreduce(span, mx)->wait();
  double bubble = 0;
  for (int s = 0; s < c.steps; ++s) {
    bubble += pipeline::pipeline_bubble(static_cast<int64_t>(compute[s].item<double>()), pg->size(),
                                        static_cast<int64_t>(-span[s][0].item<double>()),
                                        static_cast<int64_t>(span[s][1].item<double>()));
  }
  if (pg->rank() == 0) {
    const double ms = total_s * 1000.0 / c.steps;
    std::ofstream out(env::require("TDIST_BENCH_PIPELINE_RESULT"));
    out << std::setprecision(17) << batch / (ms / 1000.0) << " " << ms << " " << bubble / c.steps
        << " " << idle.item<double>() / pg->size() << "\n";
    TDIST_CHECK(out.good(), "cannot write the result file");
  }
  return 0;
}

// One tdist run of `schedule`: c.stages processes of this binary.
Figures run_tdist(const Config& c, const std::string& schedule,
                  const std::vector<std::string>& args) {
  const int port = free_port();
  char tmpl[] = "/tmp/tdist-bench-pipeline-XXXXXX";
  const int fd = ::mkstemp(tmpl);
  TDIST_CHECK(fd >= 0, "mkstemp failed");
  ::close(fd);
  const std::string result_path = tmpl;
  std::vector<std::string> worker_args{self_exe(), "pipeline", "--worker", schedule};
  worker_args.insert(worker_args.end(), args.begin(), args.end());
  std::vector<pid_t> pids;
  for (int r = 0; r < c.stages; ++r) {
    pids.push_back(
        spawn_process(worker_args,
                      {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(c.stages),
                       "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port),
                       "OMP_NUM_THREADS=1", "TDIST_BENCH_PIPELINE_RESULT=" + result_path},
                      "rank " + std::to_string(r)));
  }
  std::string failed;
  for (size_t r = 0; r < pids.size(); ++r) {
    int status = 0;
    ::waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      failed += " " + std::to_string(r);
      for (size_t k = 0; k < pids.size(); ++k) {
        if (k != r) ::kill(pids[k], SIGTERM);
      }
    }
  }
  Figures f;
  std::ifstream in(result_path);
  in >> f.samples_per_s >> f.step_ms >> f.bubble >> f.own_idle;
  std::remove(result_path.c_str());
  TDIST_CHECK(failed.empty() && f.samples_per_s > 0, "the tdist ", schedule,
              " run failed on rank(s)", failed);
  return f;
}

// One run of torch.distributed.pipelining (scripts/bench_pipeline_torch.py) on the same model.
Figures run_torch(const Config& c, const std::string& schedule) {
  std::string bounds;
  for (int64_t b : bounds_of(c, pipeline::parse_schedule(schedule))) {
    bounds += (bounds.empty() ? "" : ",") + std::to_string(b);
  }
  std::ostringstream cmd;
  cmd << "OMP_NUM_THREADS=1 " << c.python << " " << c.torch_script << " --stages " << c.stages
      << " --schedule " << schedule << " --microbatches " << c.microbatches << " --model "
      << c.model << " --width " << c.width << " --layers " << c.layers << " --heads " << c.heads
      << " --context " << c.context << " --micro-batch-size " << c.micro_batch_size << " --bounds "
      << bounds << " --warmup " << c.warmup << " --steps " << c.steps << " --threads 1 2>&1";
  int status = 0;
  const std::string out = capture_output(cmd.str(), &status);
  Figures f;
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("samples_per_s=", 0) == 0) {
      std::sscanf(line.c_str(), "samples_per_s=%lf step_ms=%lf", &f.samples_per_s, &f.step_ms);
    }
  }
  TDIST_CHECK(status == 0 && f.samples_per_s > 0, "the torch.distributed.pipelining run failed (",
              cmd.str(), "):\n", out);
  return f;
}

// PyTorch's pipelining has these three of tdist's schedules (its zero-bubble schedules are
// ZBV and interleaved zero-bubble, not ZB-H1).
bool torch_has(const std::string& schedule) {
  return schedule == "gpipe" || schedule == "1f1b" || schedule == "interleaved";
}

Figures median_of(const std::vector<Figures>& runs) {
  std::vector<double> a, b, c, d;
  for (const auto& r : runs) {
    a.push_back(r.samples_per_s);
    b.push_back(r.step_ms);
    c.push_back(r.bubble);
    d.push_back(r.own_idle);
  }
  return Figures{median(a), median(b), median(c), median(d)};
}

}  // namespace
}  // namespace pipeline_bench

int run_pipeline_bench(int argc, char** argv) {
  using namespace pipeline_bench;
  Config c;
  CLI::App app{"tdist-bench pipeline: samples/s and measured vs analytic bubble per schedule",
               "pipeline"};
  app.add_option("--stages", c.stages, "pipeline stages (processes)")->check(CLI::Range(1, 64));
  app.add_option("--microbatches", c.microbatches, "microbatches per step")
      ->check(CLI::Range(1, 4096));
  app.add_option("--schedules", c.schedules, "comma-separated: gpipe, 1f1b, interleaved, zb");
  app.add_option("--model", c.model,
                 "mlp (Linear + Tanh layers) or gpt (tdist-train's byte-level GPT)")
      ->check(CLI::IsMember({"mlp", "gpt"}));
  auto* width = app.add_option("--width", c.width,
                               "mlp: features of each Linear layer (1024); "
                               "gpt: embedding width (256)")
                    ->check(CLI::Range(1, 65536));
  auto* layers = app.add_option("--layers", c.layers,
                                "mlp: Linear + Tanh layers (8); gpt: "
                                "transformer blocks (4)")
                     ->check(CLI::Range(1, 4096));
  app.add_option("--heads", c.heads, "gpt: attention heads")->check(CLI::Range(1, 1024));
  app.add_option("--context", c.context, "gpt: bytes per sample")->check(CLI::Range(1, 1 << 16));
  auto* micro = app.add_option("--micro-batch-size", c.micro_batch_size,
                               "samples per microbatch (mlp 32, gpt 4)")
                    ->check(CLI::Range(1, 1 << 20));
  app.add_option("--warmup", c.warmup, "steps not measured")->check(CLI::Range(0, 1000));
  app.add_option("--steps", c.steps, "measured steps")->check(CLI::Range(1, 100000));
  app.add_option("--rounds", c.rounds, "alternating rounds per schedule; medians are reported")
      ->check(CLI::Range(1, 100));
  app.add_flag("!--no-torch", c.compare_torch, "skip torch.distributed.pipelining");
  app.add_option("--python", c.python, "Python with torch (the anchor)");
  app.add_option("--torch-script", c.torch_script, "path of bench_pipeline_torch.py");
  app.add_option("--json", c.json_file, "also write the results as JSON to this file");
  app.add_option("--worker", c.worker)->group("");  // internal
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (is_gpt(c)) {  // the 4-block GPT of tdist-bench fsdp, batch 16 in 4 microbatches
    if (width->count() == 0) c.width = 256;
    if (layers->count() == 0) c.layers = 4;
    if (micro->count() == 0) c.micro_batch_size = 4;
  }
  return run_or_report("tdist-bench pipeline", [&] {
    if (!c.worker.empty()) return worker_main(c);
    // The workers get this run's flags again.
    std::vector<std::string> args;
    for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
    std::vector<std::string> schedules;
    {
      std::istringstream names(c.schedules);
      for (std::string name; std::getline(names, name, ',');) {
        pipeline::parse_schedule(name);  // InvalidArgument before any process starts
        schedules.push_back(name);
      }
    }
    // A bad gpt (--width not a multiple of --heads, ...): InvalidArgument before any process.
    if (is_gpt(c)) make_model(c);
    if (c.compare_torch && c.torch_script.empty()) {
      c.torch_script = find_script("bench_pipeline_torch.py");
    }
    if (is_gpt(c)) {
      std::cout << "model " << train::describe_model(gpt_config(c))
                << ", cross-entropy on random bytes, SGD; ";
    } else {
      std::cout << "model " << c.layers << " x (Linear " << c.width << "x" << c.width
                << " + Tanh), MSE, SGD; ";
    }
    std::cout << c.stages << " stages (processes, 1 thread each), " << c.microbatches
              << " microbatches of " << c.micro_batch_size << "; " << c.steps
              << " measured steps (+" << c.warmup << " warm-up), median of " << c.rounds
              << " round(s); anchor: torch.distributed.pipelining over gloo\n\n";
    std::cout << std::left << std::setw(13) << "schedule" << std::setw(26) << "implementation"
              << std::right << std::setw(11) << "samples/s" << std::setw(10) << "step ms"
              << "   bubble measured/analytic/simulated, ratio\n";
    nlohmann::json report{{"model", c.model},
                          {"heads", c.heads},
                          {"context", c.context},
                          {"stages", c.stages},
                          {"microbatches", c.microbatches},
                          {"width", c.width},
                          {"layers", c.layers},
                          {"micro_batch_size", c.micro_batch_size},
                          {"steps", c.steps},
                          {"rounds", c.rounds},
                          {"schedules", nlohmann::json::array()}};
    for (const auto& name : schedules) {
      const auto kind = pipeline::parse_schedule(name);
      const bool with_torch = c.compare_torch && torch_has(name);
      std::vector<Figures> ours, theirs;
      for (int r = 0; r < c.rounds; ++r) {  // alternate which goes first
        if (with_torch && r % 2 == 1) theirs.push_back(run_torch(c, name));
        ours.push_back(run_tdist(c, name, args));
        if (with_torch && r % 2 == 0) theirs.push_back(run_torch(c, name));
      }
      const Figures o = median_of(ours);
      const auto sched = pipeline::make_schedule(
          kind, c.stages, c.microbatches, kind == pipeline::ScheduleKind::kInterleaved1F1B ? 2 : 1);
      nlohmann::json entry{{"schedule", name},
                           {"tdist",
                            {{"samples_per_s", o.samples_per_s},
                             {"step_ms", o.step_ms},
                             {"bubble_measured", o.bubble},
                             {"own_step_idle", o.own_idle}}},
                           {"bubble_analytic", pipeline::analytic_bubble(c.stages, c.microbatches)},
                           {"bubble_simulated", sched.simulated_bubble()}};
      std::ostringstream tail;
      tail << std::fixed << std::setprecision(3) << "   " << o.bubble << " / "
           << pipeline::analytic_bubble(c.stages, c.microbatches) << " / "
           << sched.simulated_bubble();
      if (with_torch) {
        const Figures t = median_of(theirs);
        const double ratio = o.samples_per_s / t.samples_per_s;
        std::cout << std::left << std::setw(13) << name << std::setw(26)
                  << "torch pipelining (gloo)" << std::right << std::fixed << std::setw(11)
                  << std::setprecision(1) << t.samples_per_s << std::setw(10) << t.step_ms << "\n";
        tail << ", " << std::setprecision(2) << ratio
             << "x of torch (target >= 1.2: " << (ratio >= 1.2 ? "met" : "NOT MET") << ")";
        entry["torch"] = {{"samples_per_s", t.samples_per_s}, {"step_ms", t.step_ms}};
        entry["tdist_over_torch"] = ratio;
      }
      std::cout << std::left << std::setw(13) << name << std::setw(26) << "tdist (ring)"
                << std::right << std::fixed << std::setw(11) << std::setprecision(1)
                << o.samples_per_s << std::setw(10) << o.step_ms << tail.str() << std::endl;
      report["schedules"].push_back(entry);
    }
    if (!c.json_file.empty()) std::ofstream(c.json_file) << report.dump(1) << "\n";
    return 0;
  });
}

}  // namespace tdist::bench
