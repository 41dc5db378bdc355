#pragma once
// What `tdist-bench rpc` (rpc.cpp) and `tdist-bench rpc --autograd` (autograd.cpp) share: two
// workers on this machine (this process as worker0, a copy of this binary as worker1, meeting in
// a fresh TCP store each round), rounds that alternate tdist and PyTorch, the median of each
// figure over the rounds, the PyTorch side run as a Python script that prints JSON, and the
// table of ratios against targets.

#include <sys/types.h>

#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "apps/bench/common.h"
#include "tdist/core/tcp_store.h"
#include "tdist/rpc/types.h"

namespace tdist::bench {

// Options of both workers: the store at 127.0.0.1:store_port, `threads` worker threads, a
// 120 s call timeout.
rpc::RpcOptions worker_options(int store_port, int threads);

// Starts worker1: `<this binary> rpc <flags...> --role-server --store-port P --threads T`.
pid_t spawn_server(const std::vector<std::string>& flags, int store_port, int threads);

// Runs `python3 <script> <args> 2>/dev/null` and parses the last JSON object it printed;
// std::runtime_error when it fails or prints none.
nlohmann::json run_torch_script(const std::string& script, const std::string& args);

// Runs max(o.rounds, 1) rounds: a TCPStoreServer on a kernel-picked loopback port (its port in
// o.store_port), spawn(o) -> the server's pid, ours.push_back(measure(o)) (the server is killed
// and reaped if that throws), the server reaped, then after(o): the anchor's side of the round
// (PyTorch's script, or the same work in this process), so that the two alternate.
template <class Options, class Spawn, class Measure, class After>
void run_rounds(Options& o, Spawn spawn, Measure measure, After after,
                std::vector<nlohmann::json>& ours) {
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
    after(o);
  }
}

// The first run with each of `keys` replaced by its median over the runs, and "runs": all runs.
nlohmann::json median_of(const std::vector<nlohmann::json>& runs,
                         std::initializer_list<const char*> keys);

// The table of tdist against an anchor (PyTorch, or the same work in one process): a header
// line, then per row the label and tdist's figure and, with `theirs`, the anchor's figure, the
// ratio tdist/anchor, the target and whether it is met (also written to result["ratios"][key]
// and result["met"][key]). A row whose target is kNoTarget shows its ratio with no target.
struct RatioTable {
  struct Row {
    const char* label;
    const char* key;
    bool lower_is_better;
    double target;
  };
  static constexpr double kNoTarget = -1;
  const char* title;        // over the labels
  const char* torch_title;  // over the anchor's figures
  int label_width, value_width, value_precision, ratio_width, op_width;
  std::vector<Row> rows;
};

// Prints `table`; true when every target is met (or there is nothing to compare).
bool print_ratio_table(const RatioTable& table, const nlohmann::json& ours,
                       const nlohmann::json* theirs, nlohmann::json& result);

// The end of both reports: the JSON file (when asked for) and, with PyTorch, the targets line.
void finish_report(const std::string& json_file, const nlohmann::json& result, bool torch,
                   bool all_met);

}  // namespace tdist::bench
