// tdist-bench rpc: two workers (this process and a copy of it started as the server), measured
// from rank 0:
//   round trip    median time of a small rpc_sync (two int64 in, one out), in microseconds
//   async rate    small rpc_async calls per second with --outstanding calls in flight (batches
//                 of --outstanding, each waited for: the same method as the Python side)
//   tensor echo   a --echo-mib MiB float32 tensor sent and returned, GB/s counting both ways
// Then, unless --no-torch, the same three through torch.distributed.rpc (TensorPipe) by running
// scripts/bench_rpc_torch.py, and the ratios against the targets of the RPC issue.
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "apps/bench/subcommands.h"
#include "apps/bench/two_workers.h"
#include "tdist/rpc/api.h"

namespace tdist::bench {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

struct Options {
  int rtt_iters = 5000;
  int warmup = 500;
  int async_calls = 50000;
  int outstanding = 256;
  int repeats = 3;
  int echo_mib = 16;
  int echo_iters = 30;
  int threads = 4;
  int rounds = 3;
  bool fast_path = true;
  bool torch = true;
  std::string torch_script;
  std::string json_file;
  // Internal: the server role.
  bool server = false;
  int store_port = 0;
};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void register_bench_functions() {
  rpc::register_function("bench_add", [](int64_t a, int64_t b) { return a + b; });
  rpc::register_function("bench_echo", [](at::Tensor t) { return t; });
}

rpc::RpcOptions agent_options(const Options& o) {
  rpc::RpcOptions r = worker_options(o.store_port, o.threads);
  r.same_host_fast_path = o.fast_path;
  return r;
}

int run_server(const Options& o) {
  register_bench_functions();
  auto agent = rpc::RpcAgent::start("worker1", 1, 2, agent_options(o));
  agent->shutdown(true);  // serves until the client is done too
  return 0;
}

json measure(const Options& o) {
  auto agent = rpc::RpcAgent::start("worker0", 0, 2, agent_options(o));
  const rpc::To peer("worker1");
  json r;
  r["backend"] = "tdist";
  r["fast_path"] = o.fast_path;

  const std::vector<double> rtt_s = time_calls(o.warmup, o.rtt_iters, [&](int) {
    agent->rpc_sync<int64_t>(peer, "bench_add", int64_t{1}, int64_t{2});
  });
  r["rtt_us"] = median(rtt_s) * 1e6;

  auto async_round = [&](int n) {
    auto t0 = Clock::now();
    std::vector<rpc::Future<int64_t>> fs;
    fs.reserve(o.outstanding);
    for (int done = 0; done < n;) {
      const int batch = std::min(o.outstanding, n - done);
      fs.clear();
      for (int i = 0; i < batch; ++i) {
        fs.push_back(agent->rpc_async<int64_t>(peer, "bench_add", int64_t{i}, int64_t{1}));
      }
      for (auto& f : fs) f.wait();
      done += batch;
    }
    return n / seconds_since(t0);
  };
  async_round(std::min(o.async_calls, 2000));
  std::vector<double> rates;
  for (int i = 0; i < o.repeats; ++i) rates.push_back(async_round(o.async_calls));
  r["async_calls_s"] = median(rates);
  r["outstanding"] = o.outstanding;

  const int64_t bytes = int64_t{o.echo_mib} << 20;
  at::Tensor t = at::rand({bytes / 4});
  at::Tensor back;
  const std::vector<double> echo_s = time_calls(3, o.echo_iters, [&](int) {
    back = agent->rpc_sync<at::Tensor>(peer, "bench_echo", t);
  });
  if (!back.equal(t)) throw std::runtime_error("the echoed tensor differs from the one sent");
  r["echo_bytes"] = bytes;
  r["echo_gbps"] = 2.0 * static_cast<double>(bytes) / median(echo_s) / 1e9;
  agent->shutdown(true);
  return r;
}

pid_t start_server(const Options& o) {
  std::vector<std::string> flags;
  if (!o.fast_path) flags.push_back("--no-fast-path");
  return spawn_server(flags, o.store_port, o.threads);
}

json run_torch(const Options& o) {
  std::ostringstream args;
  args << " --rtt-iters " << o.rtt_iters << " --warmup " << o.warmup << " --async-calls "
       << o.async_calls << " --outstanding " << o.outstanding << " --repeats " << o.repeats
       << " --echo-bytes " << (int64_t{o.echo_mib} << 20) << " --echo-iters " << o.echo_iters
       << " --threads " << o.threads;
  return run_torch_script(o.torch_script, args.str());
}

}  // namespace

int run_rpc_bench(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--autograd") return run_autograd_bench(argc, argv);
  }
  Options o;
  CLI::App app{"tdist-bench rpc: RPC round trip, async call rate and tensor echo, tdist vs "
               "torch.distributed.rpc (TensorPipe), two workers on this machine"};
  app.add_option("--rtt-iters", o.rtt_iters, "round trips timed");
  app.add_option("--warmup", o.warmup, "round trips before timing");
  app.add_option("--async-calls", o.async_calls, "calls per async measurement");
  app.add_option("--outstanding", o.outstanding, "async calls in flight");
  app.add_option("--repeats", o.repeats, "async measurements (median)");
  app.add_option("--echo-mib", o.echo_mib, "tensor echo size in MiB");
  app.add_option("--echo-iters", o.echo_iters, "tensor echoes timed");
  app.add_option("--threads", o.threads, "worker threads per worker (both sides)");
  app.add_option("--rounds", o.rounds,
                 "alternate tdist and torch this many times; report each figure's median "
                 "(the machine's load changes over a run)");
  app.add_flag("!--no-fast-path", o.fast_path, "send every byte through the socket");
  app.add_flag("!--no-torch", o.torch, "skip the torch.distributed.rpc side");
  app.add_option("--torch-script", o.torch_script, "path of scripts/bench_rpc_torch.py");
  app.add_option("--json", o.json_file, "also write the results as JSON to this file");
  app.add_flag("--role-server", o.server)->group("");
  app.add_option("--store-port", o.store_port)->group("");
  CLI11_PARSE(app, argc, argv);

  return run_or_report("tdist-bench rpc", [&] {
    if (o.server) return run_server(o);
    register_bench_functions();
    if (o.torch && o.torch_script.empty()) o.torch_script = find_script("bench_rpc_torch.py");
    std::vector<json> our_runs, torch_runs;
    run_rounds(o, start_server, measure, run_torch, our_runs, torch_runs);
    auto med = [](const std::vector<json>& runs) {
      return median_of(runs, {"rtt_us", "async_calls_s", "echo_gbps"});
    };
    json ours = med(our_runs);
    json result{{"tdist", ours}};
    json theirs;
    if (o.torch) {
      theirs = med(torch_runs);
      result["torch"] = theirs;
    }

    const RatioTable table{"", "torch (TP)", 28, 14, 2, 10, 9,
                           {{"rpc_sync round trip (us)", "rtt_us", true, 1.0 / 3},
                            {"rpc_async calls/s", "async_calls_s", false, 3.0},
                            {"tensor echo (GB/s)", "echo_gbps", false, 1.5}}};
    const bool all_met = print_ratio_table(table, ours, o.torch ? &theirs : nullptr, result);
    std::printf("(medians of %d alternating rounds; %d MiB echo, %d outstanding async calls, %d "
                "worker threads, fast path %s)\n",
                std::max(o.rounds, 1), o.echo_mib, o.outstanding, o.threads,
                o.fast_path ? "on" : "off");
    finish_report(o.json_file, result, o.torch, all_met);
    return 0;
  });
}

}  // namespace tdist::bench
