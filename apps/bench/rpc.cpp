// tdist-bench rpc: two workers (this process and a copy of it started as the server), measured
// from rank 0:
//   round trip    median time of a small rpc_sync (two int64 in, one out), in microseconds
//   async rate    small rpc_async calls per second with --outstanding calls in flight (batches
//                 of --outstanding, each waited for: the same method as the Python side)
//   tensor echo   a --echo-mib MiB float32 tensor sent and returned, GB/s counting both ways
// Then, unless --no-torch, the same three through torch.distributed.rpc (TensorPipe) by running
// scripts/bench_rpc_torch.py, and the ratios against the targets of the RPC issue; and the round
// trip and the echo against their bounds (Note [RPC bounds]), measured in each round.
#include <unistd.h>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "apps/bench/bounds.h"
#include "apps/bench/subcommands.h"
#include "apps/bench/two_workers.h"
#include "tdist/rpc/api.h"
#include "tdist/rpc/bounds.h"

namespace tdist::bench {
namespace rpc_bench {  // see collective.cpp
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
  int bound_bytes = 64;
  int threads = 4;
  int rounds = 3;
  bool fast_path = true;
  bool torch = true;
  std::string torch_script;
  std::string json_file;
  std::string plot;
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

// The bounds of the round trip and the echo, measured right after them (Note [RPC bounds]).
//
// Note [RPC bounds]
//   Round trip: a bare ping-pong of --bound-bytes (default 64: the 40-byte frame header and the
//   body of a small call) over a plain TCP connection on 127.0.0.1 between two threads of this
//   process, blocking sockets, TCP_NODELAY: what a request and a response over loopback TCP
//   cannot beat. Echo: the same ping-pong with the echoed tensor's bytes (GB/s counting both
//   ways, as the echo), and one thread's memcpy of them (the same-host fast path reads the
//   tensor straight from the sender's memory: at best one copy each way, so the echo's GB/s
//   counting both ways is at most memcpy's).
//   On one host a connection's frames leave TCP for shared-memory rings (Note [RPC shared-memory
//   frame streams]), so the round trip has a second bound: the same ping-pong through two such
//   rings (rpc::shm_ring_round_trips, one per direction) between two threads of this process, each
//   looking for its message as a connection's reader does between frames (no sleep, yielding
//   the core between looks).

void measure_bounds(const Options& o, json& r) {
  TcpListener listener("127.0.0.1");
  const size_t echo_bytes = r["echo_bytes"].get<size_t>();
  std::thread server([&listener, most = std::max<size_t>(o.bound_bytes, echo_bytes)] {
    TcpLink link = listener.accept();
    serve_tcp_bounds(link, most);
  });
  try {
    TcpLink link = TcpLink::connect("127.0.0.1", listener.port(), listener.key());
    r["pingpong_bytes"] = o.bound_bytes;
    r["pingpong_us"] =
        median(time_tcp(link, TcpPattern::kPingPong, o.bound_bytes, o.warmup, o.rtt_iters)) * 1e6;
    r["echo_tcp_gbps"] =
        2.0 * static_cast<double>(echo_bytes) /
        median(time_tcp(link, TcpPattern::kPingPong, echo_bytes, 3, o.echo_iters)) / 1e9;
  } catch (...) {
    // The link is closed, so a server thread that accepted it returns; one still in accept()
    // (connect failed) is released by one more connection, closed at once.
    try {
      TcpLink::connect("127.0.0.1", listener.port(), listener.key(), 1);
    } catch (...) {}
    server.join();
    throw;
  }
  server.join();
  r["ring_pingpong_us"] =
      median(rpc::shm_ring_round_trips(static_cast<size_t>(o.bound_bytes), o.warmup, o.rtt_iters)) *
      1e6;
  r["memcpy_gbps"] =
      static_cast<double>(echo_bytes) / median(time_memcpy(echo_bytes, 3, o.echo_iters)) / 1e9;
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
  const std::vector<double> echo_s = time_calls(
      3, o.echo_iters, [&](int) { back = agent->rpc_sync<at::Tensor>(peer, "bench_echo", t); });
  if (!back.equal(t)) throw std::runtime_error("the echoed tensor differs from the one sent");
  r["echo_bytes"] = bytes;
  r["echo_gbps"] = 2.0 * static_cast<double>(bytes) / median(echo_s) / 1e9;
  agent->shutdown(true);
  measure_bounds(o, r);
  return r;
}

// The figures against their bounds (Note [RPC bounds]), also into result["bounds"]; whether
// both bound targets were met.
bool print_bounds(const json& ours, json& result) {
  const double rtt = ours["rtt_us"].get<double>(), pp = ours["pingpong_us"].get<double>();
  const double echo = ours["echo_gbps"].get<double>();
  const double tcp = ours["echo_tcp_gbps"].get<double>(), mem = ours["memcpy_gbps"].get<double>();
  const double ring = ours["ring_pingpong_us"].get<double>();
  const bool rtt_met = rtt <= 15, echo_met = echo / mem >= 0.8;
  std::printf("\nagainst the bounds (medians of the rounds):\n");
  std::printf(
      "%-28s %10.2f  bound: TCP ping-pong of %lld bytes %8.2f us  bound/ours %.3f "
      "(target: round trip <= 15 us: %s)\n",
      "rpc_sync round trip (us)", rtt, ours["pingpong_bytes"].get<long long>(), pp, pp / rtt,
      rtt_met ? "met" : "NOT MET");
  std::printf("%-28s %10s  bound: shared-memory ring ping-pong %8.2f us  bound/ours %.3f\n", "", "",
              ring, ring / rtt);
  std::printf(
      "%-28s %10.2f  bound: memcpy %8.2f GB/s  ours/bound %.3f (target >= 0.80: %s); "
      "TCP ping-pong %.2f GB/s, ours/TCP %.3f\n",
      "tensor echo (GB/s)", echo, mem, echo / mem, echo_met ? "met" : "NOT MET", tcp, echo / tcp);
  result["bounds"] = {{"rtt_over_pingpong", rtt / pp},
                      {"pingpong_over_rtt", pp / rtt},
                      {"ring_pingpong_over_rtt", ring / rtt},
                      {"echo_over_memcpy", echo / mem},
                      {"echo_over_tcp", echo / tcp}};
  result["met"]["rtt_bound"] = rtt_met;
  result["met"]["echo_bound"] = echo_met;
  return rtt_met && echo_met;
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
}  // namespace rpc_bench

int run_rpc_bench(int argc, char** argv) {
  using namespace rpc_bench;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--autograd") return run_autograd_bench(argc, argv);
  }
  Options o;
  CLI::App app{
      "tdist-bench rpc: RPC round trip, async call rate and tensor echo, tdist vs "
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
  app.add_option("--bound-bytes", o.bound_bytes, "message size of the TCP ping-pong bound")
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--json", o.json_file, "also write the results as JSON to this file");
  app.add_option("--plot", o.plot,
                 "draw the figures against the bound and PyTorch to this PNG "
                 "(the JSON goes to --json, else FILE.json)");
  app.add_flag("--role-server", o.server)->group("");
  app.add_option("--store-port", o.store_port)->group("");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  return run_or_report("tdist-bench rpc", [&] {
    if (o.server) return run_server(o);
    register_bench_functions();
    if (o.torch && o.torch_script.empty()) o.torch_script = find_script("bench_rpc_torch.py");
    std::vector<json> our_runs, torch_runs;
    RoundTrips trips;  // Note [Core-to-core round trip] in bounds.h
    trips.before = core_round_trip();
    run_rounds(
        o, start_server, measure,
        [&](Options& opts) {
          if (opts.torch) torch_runs.push_back(run_torch(opts));
        },
        our_runs);
    trips.after = core_round_trip();
    auto med = [](const std::vector<json>& runs) {
      return median_of(runs, {"rtt_us", "async_calls_s", "echo_gbps"});
    };
    // Ours also carries the bounds of its rounds (measure_bounds), PyTorch's does not.
    json ours = median_of(our_runs, {"rtt_us", "async_calls_s", "echo_gbps", "pingpong_us",
                                     "ring_pingpong_us", "echo_tcp_gbps", "memcpy_gbps"});
    json result{{"tdist", ours}};
    json theirs;
    if (o.torch) {
      theirs = med(torch_runs);
      result["torch"] = theirs;
    }

    const RatioTable table{"",
                           "torch (TP)",
                           28,
                           14,
                           2,
                           10,
                           9,
                           {{"rpc_sync round trip (us)", "rtt_us", true, 1.0 / 3},
                            {"rpc_async calls/s", "async_calls_s", false, 3.0},
                            {"tensor echo (GB/s)", "echo_gbps", false, 1.5}}};
    const bool all_met = print_ratio_table(table, ours, o.torch ? &theirs : nullptr, result);
    std::printf(
        "(medians of %d alternating rounds; %d MiB echo, %d outstanding async calls, %d "
        "worker threads, fast path %s)\n",
        std::max(o.rounds, 1), o.echo_mib, o.outstanding, o.threads, o.fast_path ? "on" : "off");
    const bool bounds_met = print_bounds(ours, result);
    std::printf("%s\n", trips.describe("the rounds").c_str());
    result["core_round_trip"] = trips.json();
    std::string json_path = o.json_file;
    if (json_path.empty() && !o.plot.empty()) json_path = o.plot + ".json";
    finish_report(json_path, result, o.torch, all_met && bounds_met);
    if (!o.plot.empty()) draw_plot("python3", "rpc", json_path, o.plot);
    return 0;
  });
}

}  // namespace tdist::bench
