#pragma once
// What the two RPC benchmarks (bench_rpc.cpp, bench_autograd.cpp) share: rounds that each start a
// fresh TCP store and a server process, measure tdist, then (optionally) PyTorch; and the median
// of each figure over the rounds.

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>

#include <algorithm>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <vector>

#include "tdist/core/tcp_store.h"

namespace tdist::bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Runs max(o.rounds, 1) rounds: a TCPStoreServer on a kernel-picked loopback port (its port in
// o.store_port), spawn(o) -> the server's pid, ours.push_back(measure(o)) (the server is killed
// and reaped if that throws), the server reaped, then theirs.push_back(torch(o)) when o.torch.
template <class Options, class Spawn, class Measure, class Torch>
void run_rounds(Options& o, Spawn spawn, Measure measure, Torch torch,
                std::vector<nlohmann::json>& ours, std::vector<nlohmann::json>& theirs) {
  for (int round = 0; round < std::max(o.rounds, 1); ++round) {
    TCPStoreServer store("127.0.0.1", 0);
    o.store_port = store.port();
    pid_t server = spawn(o);
    try {
      ours.push_back(measure(o));
    } catch (...) {
      ::kill(server, SIGKILL);
      ::waitpid(server, nullptr, 0);
      throw;
    }
    int status = 0;
    ::waitpid(server, &status, 0);
    if (o.torch) theirs.push_back(torch(o));
  }
}

// The first run with each of `keys` replaced by its median over the runs, and "runs": all runs.
inline nlohmann::json median_of(const std::vector<nlohmann::json>& runs,
                                std::initializer_list<const char*> keys) {
  nlohmann::json m = runs.front();
  for (const char* key : keys) {
    std::vector<double> v;
    for (const auto& r : runs) v.push_back(r[key].get<double>());
    m[key] = median(v);
  }
  m["runs"] = runs;
  return m;
}

}  // namespace tdist::bench
