// tdist-bench ddp: training throughput of tdist's DistributedDataParallel, measured side by side
// with its compute-only bound (world size 1: plain libtorch; world size N: N independent
// plain-libtorch processes training at the same time, `ddp --bound-worker`) and with PyTorch's
// Python DDP over gloo (scripts/bench_ddp_torch.py) on the same model, batch and world size.
// Reports samples/s and the ratios. The world-size-N run starts N copies of this binary
// (`ddp --worker`) on 127.0.0.1.
// --device cuda trains on GPU LOCAL_RANK (world N needs N GPUs: NCCL takes one per rank), each
// step ending with a device synchronize on every side; at world 1 PyTorch's DDP over NCCL
// (world 1) runs beside plain libtorch and tdist's DDP.
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "apps/bench/bounds.h"
#include "apps/bench/common.h"
#include "apps/bench/subcommands.h"
#include "apps/common/device.h"
#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"
#include "tdist/core/hash_store.h"
#include "tdist/core/rendezvous.h"
#include "tdist/ddp/bucket.h"
#include "tdist/ddp/distributed_data_parallel.h"

namespace tdist::bench {
namespace ddp_bench {  // see collective.cpp
namespace {

struct Config {
  int world_size = 2;
  int iters = 200;
  int warmup = 20;
  int batch = 16;
  int hidden = 1024;
  int layers = 3;
  double lr = 0.01;
  double bucket_cap_mb = 25.0;
  bool bucket_view = false;  // DDPOptions::gradient_as_bucket_view
  int threads = 1;
  int rounds = 3;
  bool compare_torch = true;
  bool skip_world1 = false;
  std::string python = "python3";
  std::string torch_script;         // --torch-script; empty: find_script("bench_ddp_torch.py")
  std::vector<int> world_sizes{2};  // world_size takes each in turn
  std::string device = "cpu";       // --device: cpu or cuda
  c10::Device dev{c10::kCPU};       // what it resolved to in this process
  std::string json_file;
  std::string plot;
  bool worker = false;        // internal: this process is one rank of the tdist run
  bool bound_worker = false;  // internal: one process of the compute-only bound
};

struct Result {
  double samples_per_s = 0;
  double iter_ms = 0;
  // The compute-only bound's processes only (Note [The bound with the reduction's CPU]): that
  // bound with the reduction's CPU time added to every step, and that CPU time (the median over
  // the ranks); 0 when not measured (world 1, a GPU).
  double counted_samples_per_s = 0;
  double reduce_cpu_ms = 0;
};

torch::nn::Sequential make_model(const Config& c) {
  torch::nn::Sequential m;
  m->push_back(torch::nn::Linear(784, c.hidden));
  m->push_back(torch::nn::ReLU());
  for (int i = 1; i < c.layers; ++i) {
    m->push_back(torch::nn::Linear(c.hidden, c.hidden));
    m->push_back(torch::nn::ReLU());
  }
  m->push_back(torch::nn::Linear(c.hidden, 10));
  m->to(c.dev);
  return m;
}

// Trains warmup + iters SGD steps with `forward`; `sync` runs before and after the timed part.
template <typename Forward>
Result train(const Config& c, int rank, int world, std::vector<torch::Tensor> params,
             Forward&& forward, const std::function<void()>& sync) {
  torch::optim::SGD opt(params, c.lr);
  auto gen = at::detail::createCPUGenerator(100 + rank);
  std::vector<torch::Tensor> xs, ys;
  for (int i = 0; i < 4; ++i) {
    xs.push_back(at::randn({c.batch, 784}, gen, at::TensorOptions()).to(c.dev));
    ys.push_back(
        at::randint(0, 10, {c.batch}, gen, at::TensorOptions().dtype(at::kLong)).to(c.dev));
  }
  auto step = [&](int i) {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(forward(xs[i % 4]), ys[i % 4]).backward();
    opt.step();
    if (c.dev.is_cuda()) torch::cuda::synchronize(c.dev.index());  // the step's time is the GPU's
  };
  time_calls(c.warmup, 0, step);
  sync();
  auto start = std::chrono::steady_clock::now();
  const std::vector<double> times = time_calls(0, c.iters, step);
  sync();
  double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return Result{static_cast<double>(world) * c.batch * c.iters / total, median(times) * 1e3};
}

Result run_plain(
    const Config& c, const std::function<void()>& sync = [] {}) {
  torch::manual_seed(0);
  auto model = make_model(c);
  return train(
      c, 0, 1, model->parameters(), [&](const torch::Tensor& x) { return model->forward(x); },
      sync);
}

Result run_ddp(const Config& c, std::shared_ptr<comm::ProcessGroup> pg) {
  torch::manual_seed(0);
  auto model = make_model(c);
  ddp::DDPOptions opts;
  opts.bucket_cap_mb = c.bucket_cap_mb;
  opts.gradient_as_bucket_view = c.bucket_view;
  ddp::DistributedDataParallel<torch::nn::Sequential> ddp_model(model, pg, opts);
  auto sync = [&] { pg->barrier()->wait(); };
  return train(
      c, pg->rank(), pg->size(), ddp_model.parameters(),
      [&](const torch::Tensor& x) { return ddp_model(x); }, sync);
}

void write_worker_result(const Result& r) {
  const char* path = std::getenv("TDIST_BENCH_DDP_RESULT");
  TDIST_CHECK(path != nullptr, "TDIST_BENCH_DDP_RESULT is not set");
  std::ofstream f(path);
  f << r.samples_per_s << " " << r.iter_ms << " " << r.counted_samples_per_s << " "
    << r.reduce_cpu_ms << "\n";
}

// Note [The bound with the reduction's CPU]
// The compute-only bound (N plain processes training side by side, no communication) leaves out
// the work the reduction of the gradients itself takes: with one core per rank (world 2 on the
// 2-core machine) every microsecond of copying and reducing comes out of the core that computes,
// and no overlap can hide it. So the bound processes, after training, also measure that cost:
// they form a process group, lay the model's gradients out in DDP's buckets (assign_buckets in
// reverse parameter order, first_bucket_cap_mb then --bucket-cap-mb, in the group's symmetric
// memory as DDP allocates them: the cheapest reduction tdist has) and allreduce the buckets'
// flat tensors step after step (every bucket issued, then all waited on, as DDP's backward
// does), with spinning off (TDIST_SPIN_US and TDIST_BUSY_POLL_NS 0: a rank that waits for its
// peer sleeps, so the waiting is not counted); the process's CPU time
// (CLOCK_PROCESS_CPUTIME_ID, every thread) over those steps, per step, is the reduction's cost
// r. A process that trained at s samples/s (batch B: B/s seconds of compute per step) could
// then at best train at B / (B/s + r), and the bound is the sum over the processes. It counts
// only the allreduce, not DDP's copies into and out of its buckets, which are DDP's own cost;
// and it assumes one core per rank (with idle cores the reduction could run beside the
// computation, and this bound is below what is possible).
double reduction_cpu_s(const Config& c, std::shared_ptr<Store> store, int rank, int world) {
  comm::ProcessGroup::Options o;
  o.ring.spin_us = 0;
  o.ring.busy_poll_ns = 0;
  auto pg = comm::create_process_group(std::move(store), rank, world, o);
  torch::manual_seed(0);
  const std::vector<torch::Tensor> params = make_model(c)->parameters();
  std::vector<size_t> order(params.size());
  std::iota(order.rbegin(), order.rend(), size_t{0});  // DDP's default: reverse parameter order
  const double mib = 1024.0 * 1024.0;
  const auto groups = ddp::assign_buckets(
      params, order, static_cast<size_t>(ddp::DDPOptions{}.first_bucket_cap_mb * mib),
      static_cast<size_t>(c.bucket_cap_mb * mib));
  std::vector<at::Tensor> buckets;
  for (const auto& g : groups) {
    int64_t n = 0;
    for (size_t i : g) n += params[i].numel();
    buckets.push_back(pg->symmetric_empty({n}, at::kFloat).zero_());  // as DDP's (its Note 12)
  }
  std::vector<std::shared_ptr<comm::Work>> works;
  auto step = [&] {
    works.clear();
    for (const auto& b : buckets) works.push_back(pg->allreduce(b));
    for (const auto& w : works) w->wait();
  };
  for (int i = 0; i < std::min(c.warmup, 10); ++i) step();
  pg->barrier()->wait();
  const int steps = std::max(1, std::min(c.iters, 100));
  timespec t0{}, t1{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t0);
  for (int i = 0; i < steps; ++i) step();
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t1);
  pg->barrier()->wait();
  return ((t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9) / steps;
}

// One rank of the world-size-N tdist run (a child of the launcher).
int worker_main(Config c) {
  c.dev = apps::resolve_device("--device", c.device);  // before anything asks libtorch about CUDA
  torch::set_num_threads(c.threads);
  auto rdzv = rendezvous("env://", -1, -1, std::chrono::seconds(120));
  auto pg = comm::create_process_group(rdzv.store, rdzv.rank, rdzv.world_size);
  Result r = run_ddp(c, pg);
  if (rdzv.rank == 0) write_worker_result(r);
  pg->barrier()->wait();  // rank 0 hosts the store: leave together
  return 0;
}

// One of the N processes of the compute-only bound (a child of the launcher): plain libtorch, no
// process group and no communication while it trains. The store only lines the processes up
// before and after the timed part, as DDP's barriers do, so they train at the same time and each
// one's samples/s is counted over the same span; rank 0 reports the sum over the processes.
int bound_worker_main(Config c) {
  c.dev = apps::resolve_device("--device", c.device);
  torch::set_num_threads(c.threads);
  auto rdzv = rendezvous("env://", -1, -1, std::chrono::seconds(120));
  Store& store = *rdzv.store;
  const std::string prefix = "tdist-bench/ddp-bound/";
  int syncs = 0;
  auto sync = [&] {
    const std::string key = prefix + "sync/" + std::to_string(syncs++);
    if (store.add(key, 1) == rdzv.world_size) store.set(key + "/go", "1");
    store.wait({key + "/go"});
  };
  Result r = run_plain(c, sync);
  // Note [The bound with the reduction's CPU]: after the training, so it takes nothing from it.
  const double reduce_s = c.dev.is_cpu() && rdzv.world_size > 1
                              ? reduction_cpu_s(c, rdzv.store, rdzv.rank, rdzv.world_size)
                              : 0.0;
  const double counted = reduce_s > 0 ? c.batch / (c.batch / r.samples_per_s + reduce_s) : 0.0;
  const std::string me = std::to_string(rdzv.rank);
  store.set(prefix + "reduce_s/" + me, std::to_string(reduce_s));
  store.set(prefix + "counted/" + me, std::to_string(counted));
  store.set(prefix + "samples_per_s/" + me, std::to_string(r.samples_per_s));
  if (rdzv.rank == 0) {
    Result sum{0, r.iter_ms};
    std::vector<double> reduce_ms;
    for (int k = 0; k < rdzv.world_size; ++k) {
      const std::string rank = std::to_string(k);
      sum.samples_per_s += std::stod(store.get_string(prefix + "samples_per_s/" + rank));
      sum.counted_samples_per_s += std::stod(store.get_string(prefix + "counted/" + rank));
      reduce_ms.push_back(std::stod(store.get_string(prefix + "reduce_s/" + rank)) * 1e3);
    }
    sum.reduce_cpu_ms = median(reduce_ms);
    write_worker_result(sum);
  }
  // No barrier to leave: rank 0 hosts the store and leaves only after reading every result, the
  // last store operation of the others, so none of them waits on the store when it goes. (A
  // final barrier raced: its last arrival, rank 0, could exit before the store had answered a
  // rank still waiting in it.)
  return 0;
}

// Starts c.world_size processes `worker_args` (ranks of one env:// rendezvous on 127.0.0.1) and
// returns what rank 0 wrote to TDIST_BENCH_DDP_RESULT.
Result run_world(const Config& c, const std::vector<std::string>& worker_args) {
  const int port = free_port();
  char tmpl[] = "/tmp/tdist-bench-ddp-XXXXXX";
  int fd = ::mkstemp(tmpl);
  TDIST_CHECK(fd >= 0, "mkstemp failed");
  ::close(fd);
  const std::string result_path = tmpl;
  std::vector<pid_t> pids;
  for (int r = 0; r < c.world_size; ++r) {
    pids.push_back(spawn_process(
        worker_args,
        {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(c.world_size),
         "LOCAL_RANK=" + std::to_string(r), "MASTER_ADDR=127.0.0.1",
         "MASTER_PORT=" + std::to_string(port), "OMP_NUM_THREADS=" + std::to_string(c.threads),
         "TDIST_BENCH_DDP_RESULT=" + result_path},
        "rank " + std::to_string(r)));
  }
  std::string failed;
  for (int r = 0; r < c.world_size; ++r) {
    int status = 0;
    ::waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      failed += " rank " + std::to_string(r);
      for (int k = 0; k < c.world_size; ++k) {
        if (k != r) ::kill(pids[k], SIGTERM);
      }
    }
  }
  std::ifstream f(result_path);
  Result res;
  f >> res.samples_per_s >> res.iter_ms >> res.counted_samples_per_s >> res.reduce_cpu_ms;
  std::remove(result_path.c_str());
  TDIST_CHECK(failed.empty() && res.samples_per_s > 0, worker_args[2], " workers failed:", failed);
  return res;
}

Result run_torch_world(const Config& c) {
  std::ostringstream cmd;
  cmd << c.python << " " << c.torch_script << " --world-size " << c.world_size << " --iters "
      << c.iters << " --warmup " << c.warmup << " --batch " << c.batch << " --hidden " << c.hidden
      << " --layers " << c.layers << " --lr " << c.lr << " --bucket-cap-mb " << c.bucket_cap_mb
      << (c.bucket_view ? " --gradient-as-bucket-view" : "") << " --threads " << c.threads
      << " --device " << c.device << " 2>&1";
  int rc = 0;
  const std::string out = capture_output(cmd.str(), &rc);
  std::string line;
  Result res;
  std::istringstream is(out);
  while (std::getline(is, line)) {
    if (line.rfind("samples_per_s=", 0) == 0) {
      std::sscanf(line.c_str(), "samples_per_s=%lf iter_ms=%lf", &res.samples_per_s, &res.iter_ms);
    }
  }
  TDIST_CHECK(rc == 0 && res.samples_per_s > 0, "PyTorch DDP run failed (", cmd.str(), "):\n", out);
  return res;
}

// Each figure's median over the rounds.
Result median_result(const std::vector<Result>& rs) {
  std::vector<double> samples_per_s, iter_ms, counted, reduce_ms;
  for (const auto& r : rs) {
    samples_per_s.push_back(r.samples_per_s);
    iter_ms.push_back(r.iter_ms);
    counted.push_back(r.counted_samples_per_s);
    reduce_ms.push_back(r.reduce_cpu_ms);
  }
  return Result{median(samples_per_s), median(iter_ms), median(counted), median(reduce_ms)};
}

void print_row(const std::string& world, const std::string& what, const Result& r,
               const std::string& ratio) {
  std::cout << std::left << std::setw(7) << world << std::setw(34) << what << std::right
            << std::setw(12) << std::fixed << std::setprecision(1) << r.samples_per_s
            << std::setw(11) << std::setprecision(2) << r.iter_ms << "   " << ratio << "\n";
}

}  // namespace
}  // namespace ddp_bench

int run_ddp_bench(int argc, char** argv) {
  using namespace ddp_bench;
  Config c;
  CLI::App app{
      "tdist-bench ddp: DDP training throughput (samples/s) of tdist against its bound "
      "(N independent plain-libtorch processes training at the same time, no "
      "communication; world size 1: plain libtorch) and PyTorch's Python DDP over gloo, "
      "side by side in one run. Model: MLP 784-H-...-H-10, cross-entropy, SGD."};
  app.add_option("--world-size", c.world_sizes,
                 "ranks of the distributed comparisons (one or more)")
      ->check(CLI::Range(2, 64));
  app.add_option("--iters", c.iters, "timed iterations per run")->check(CLI::Range(1, 1000000));
  app.add_option("--warmup", c.warmup, "untimed iterations first")->check(CLI::Range(0, 1000000));
  app.add_option("--batch", c.batch, "samples per rank")->check(CLI::Range(1, 1 << 20));
  app.add_option("--hidden", c.hidden, "hidden width")->check(CLI::Range(1, 1 << 16));
  app.add_option("--layers", c.layers, "hidden layers")->check(CLI::Range(1, 64));
  app.add_option("--lr", c.lr, "SGD learning rate");
  app.add_option("--bucket-cap-mb", c.bucket_cap_mb, "DDP bucket_cap_mb")
      ->check(CLI::PositiveNumber);
  app.add_flag("--gradient-as-bucket-view", c.bucket_view,
               "DDP gradient_as_bucket_view: .grad is a view of its bucket (no copy in or out)");
  app.add_option("--threads", c.threads, "intra-op threads per rank")->check(CLI::Range(1, 256));
  app.add_option("--device", c.device,
                 "cpu, or cuda (GPU LOCAL_RANK: world N needs N GPUs; "
                 "PyTorch's DDP then runs over NCCL, at world 1 too)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--rounds", c.rounds, "alternating rounds; medians are reported")
      ->check(CLI::Range(1, 100));
  app.add_flag("!--no-torch", c.compare_torch, "skip PyTorch's Python DDP");
  app.add_flag("--skip-world1", c.skip_world1, "skip the world-size-1 comparison");
  app.add_option("--python", c.python, "Python with torch (the anchor) and matplotlib (--plot)");
  app.add_option("--torch-script", c.torch_script, "path of bench_ddp_torch.py");
  app.add_option("--json", c.json_file, "also write the results as JSON to this file");
  app.add_option("--plot", c.plot,
                 "draw samples/s against the bound and PyTorch to this PNG "
                 "(the JSON goes to --json, else FILE.json)");
  app.add_flag("--worker", c.worker, "internal: run as one rank (RANK, WORLD_SIZE, MASTER_*)");
  app.add_flag("--bound-worker", c.bound_worker, "internal: one process of the compute-only bound");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return run_or_report("tdist-bench ddp", [&] {
    if (c.worker) return worker_main(c);
    if (c.bound_worker) return bound_worker_main(c);
    if (c.compare_torch && c.torch_script.empty())
      c.torch_script = find_script("bench_ddp_torch.py");
    c.dev = apps::resolve_device("--device", c.device);
    torch::set_num_threads(c.threads);
    RoundTrips trips;  // Note [Core-to-core round trip] in bounds.h
    trips.before = core_round_trip();
    std::cout << "model MLP 784-" << c.hidden << "x" << c.layers << "-10, batch " << c.batch
              << " per rank, SGD, " << c.iters << " timed iterations (+" << c.warmup
              << " warm-up), " << c.threads << " thread(s) per rank, median of " << c.rounds
              << " rounds (alternating which side runs first)"
              << (c.bucket_view ? ", gradients as bucket views" : "") << ", device " << c.dev
              << "\n"
              << "bound: N independent plain-libtorch processes training at the same time (no "
                 "communication); world 1: plain libtorch; '+ reduction CPU': that bound with "
                 "the CPU time of the gradients' allreduce added to each step (docs/perf.md)\n\n";
    std::cout << std::left << std::setw(7) << "world" << std::setw(34) << "implementation"
              << std::right << std::setw(12) << "samples/s" << std::setw(11) << "iter ms"
              << "   ratio\n";
    auto to_json = [](const Result& r) {
      return nlohmann::json{{"samples_per_s", r.samples_per_s}, {"iter_ms", r.iter_ms}};
    };
    nlohmann::json report{{"hidden", c.hidden},
                          {"layers", c.layers},
                          {"batch", c.batch},
                          {"device", c.device},
                          {"gradient_as_bucket_view", c.bucket_view},
                          {"iters", c.iters},
                          {"rounds", c.rounds},
                          {"worlds", nlohmann::json::array()}};
    // The target of the issue on DDP against the bound, by world size (none for the others).
    auto target_of = [](int world) {
      return world == 1 ? 0.98 : world == 2 ? 0.9 : world == 4 ? 0.8 : 0;
    };
    auto bound_ratio = [&](int world, const Result& ours, const Result& bound) {
      std::ostringstream s;
      s << std::setprecision(3) << std::fixed << ours.samples_per_s / bound.samples_per_s
        << " of bound";
      if (target_of(world) > 0) {
        s << " (target >= " << std::setprecision(2) << target_of(world) << ": "
          << (ours.samples_per_s / bound.samples_per_s >= target_of(world) ? "met" : "NOT MET")
          << ")";
      }
      return s.str();
    };
    // PyTorch's row, and its ratio put before `ratio` and into `entry`.
    auto add_torch = [&](const std::string& world, const Result& ours,
                         const std::vector<Result>& theirs, std::string& ratio,
                         nlohmann::json& entry) {
      Result t = median_result(theirs);
      print_row(world,
                c.dev.is_cuda() ? "PyTorch DDP (Python, nccl)" : "PyTorch DDP (Python, gloo)", t,
                "");
      std::ostringstream vs;
      vs << std::setprecision(3) << std::fixed << ours.samples_per_s / t.samples_per_s
         << "x of PyTorch, ";
      ratio = vs.str() + ratio;
      entry["torch"] = to_json(t);
      entry["tdist_over_torch"] = ours.samples_per_s / t.samples_per_s;
    };
    if (!c.skip_world1) {
      std::vector<Result> plain, ddp1, torch1;
      auto pg = comm::create_process_group(std::make_shared<HashStore>(), 0, 1);
      // On a GPU, PyTorch's DDP over NCCL at world 1 too: there is no second GPU to compare on.
      const bool torch_world1 = c.compare_torch && c.dev.is_cuda();
      c.world_size = 1;
      for (int r = 0; r < c.rounds; ++r) {  // alternate which goes first
        if (r % 2 == 0) plain.push_back(run_plain(c));
        if (torch_world1 && r % 2 == 1) torch1.push_back(run_torch_world(c));
        ddp1.push_back(run_ddp(c, pg));
        if (torch_world1 && r % 2 == 0) torch1.push_back(run_torch_world(c));
        if (r % 2 == 1) plain.push_back(run_plain(c));
      }
      Result p = median_result(plain), d = median_result(ddp1);
      nlohmann::json entry{{"world", 1},
                           {"bound", to_json(p)},
                           {"tdist", to_json(d)},
                           {"tdist_over_bound", d.samples_per_s / p.samples_per_s}};
      print_row("1", "bound: libtorch, no DDP", p, "");
      std::string ratio = bound_ratio(1, d, p);
      if (torch_world1) add_torch("1", d, torch1, ratio, entry);
      print_row("1", "tdist DDP", d, ratio);
      report["worlds"].push_back(entry);
    }
    for (int world : c.world_sizes) {
      if (c.dev.is_cuda() && world > static_cast<int>(torch::cuda::device_count())) {
        std::cout << world << "      skipped: NCCL takes a GPU per rank and "
                  << torch::cuda::device_count() << " are visible\n";
        continue;
      }
      c.world_size = world;
      std::vector<std::string> worker_args{"/proc/self/exe", "ddp", "--worker"};
      std::vector<std::string> bound_args{"/proc/self/exe", "ddp", "--bound-worker"};
      for (int i = 1; i < argc; ++i) {
        worker_args.push_back(argv[i]);
        bound_args.push_back(argv[i]);
      }
      std::vector<Result> ours, theirs, bound;
      for (int r = 0; r < c.rounds; ++r) {  // alternate which goes first
        if (c.compare_torch && r % 2 == 1) theirs.push_back(run_torch_world(c));
        if (r % 2 == 1) bound.push_back(run_world(c, bound_args));
        ours.push_back(run_world(c, worker_args));
        if (r % 2 == 0) bound.push_back(run_world(c, bound_args));
        if (c.compare_torch && r % 2 == 0) theirs.push_back(run_torch_world(c));
      }
      const std::string w = std::to_string(world);
      Result o = median_result(ours), b = median_result(bound);
      nlohmann::json entry{{"world", world},
                           {"bound", to_json(b)},
                           {"tdist", to_json(o)},
                           {"tdist_over_bound", o.samples_per_s / b.samples_per_s}};
      print_row(w, "bound: " + w + " x libtorch, no comm.", b, "");
      if (b.counted_samples_per_s > 0) {
        // Note [The bound with the reduction's CPU].
        const Result counted{b.counted_samples_per_s, b.iter_ms + b.reduce_cpu_ms};
        std::ostringstream what, ratio;
        what << "  + reduction CPU " << std::setprecision(2) << std::fixed << b.reduce_cpu_ms
             << " ms/step";
        ratio << std::setprecision(3) << std::fixed << o.samples_per_s / b.counted_samples_per_s
              << " of it"
              << (world == 2 ? std::string(o.samples_per_s / b.counted_samples_per_s >= 0.9
                                               ? " (target >= 0.90: met)"
                                               : " (target >= 0.90: NOT MET)")
                             : std::string());
        print_row(w, what.str(), counted, ratio.str());
        entry["bound_with_reduction"] = {{"samples_per_s", b.counted_samples_per_s},
                                         {"reduce_cpu_ms", b.reduce_cpu_ms}};
        entry["tdist_over_bound_with_reduction"] = o.samples_per_s / b.counted_samples_per_s;
      }
      std::string ratio = bound_ratio(world, o, b);
      if (c.compare_torch) add_torch(w, o, theirs, ratio, entry);
      print_row(w, c.dev.is_cuda() ? "tdist DDP (nccl)" : "tdist DDP (ring)", o, ratio);
      report["worlds"].push_back(entry);
    }
    trips.after = core_round_trip();
    std::cout << "\n" << trips.describe("the runs") << "\n";
    report["core_round_trip"] = trips.json();
    std::string json = c.json_file;
    if (json.empty() && !c.plot.empty()) json = c.plot + ".json";
    if (!json.empty()) std::ofstream(json) << report.dump(1) << "\n";
    if (!c.plot.empty()) draw_plot(c.python, "ddp", json, c.plot);
    return 0;
  });
}

}  // namespace tdist::bench
