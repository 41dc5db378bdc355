#include "apps/bench/two_workers.h"

#include <cstdio>
#include <fstream>
#include <memory>
#include <stdexcept>

namespace tdist::bench {

rpc::RpcOptions worker_options(int store_port, int threads) {
  rpc::RpcOptions r;
  r.store = std::make_shared<TCPStore>("127.0.0.1", static_cast<uint16_t>(store_port), false,
                                       std::chrono::seconds(60));
  // Both workers are on this host and the bare TCP bound it is compared with runs on 127.0.0.1:
  // keep the agents there too rather than on the address they would pick for other hosts.
  r.listen_host = "127.0.0.1";
  r.num_worker_threads = threads;
  r.rpc_timeout = std::chrono::seconds(120);
  return r;
}

pid_t spawn_server(const std::vector<std::string>& flags, int store_port, int threads) {
  std::vector<std::string> args{self_exe(), "rpc"};
  args.insert(args.end(), flags.begin(), flags.end());
  for (std::string a :
       {std::string("--role-server"), std::string("--store-port"), std::to_string(store_port),
        std::string("--threads"), std::to_string(threads)}) {
    args.push_back(std::move(a));
  }
  return spawn_process(args, {}, "the worker1 process");
}

nlohmann::json run_torch_script(const std::string& script, const std::string& args) {
  const std::string cmd = "python3 " + script + args + " 2>/dev/null";
  int rc = 0;
  const std::string out = capture_output(cmd, &rc);
  if (rc != 0)
    throw std::runtime_error("'" + cmd + "' failed (exit status " + std::to_string(rc) + ")");
  auto brace = out.find_last_of('{');
  if (brace == std::string::npos) throw std::runtime_error("no JSON from " + script);
  return nlohmann::json::parse(out.substr(brace));
}

nlohmann::json median_of(const std::vector<nlohmann::json>& runs,
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

bool print_ratio_table(const RatioTable& t, const nlohmann::json& ours,
                       const nlohmann::json* theirs, nlohmann::json& result) {
  std::printf("%-*s %*s", t.label_width, t.title, t.value_width, "tdist");
  if (theirs) {
    std::printf(" %*s %*s %10s", t.value_width, t.torch_title, t.ratio_width, "ratio", "target");
  }
  std::printf("\n");
  bool all_met = true;
  for (const auto& row : t.rows) {
    const double a = ours[row.key].get<double>();
    std::printf("%-*s %*.*f", t.label_width, row.label, t.value_width, t.value_precision, a);
    if (theirs) {
      const double b = (*theirs)[row.key].get<double>();
      const double ratio = a / b;
      std::printf(" %*.*f %*.3f", t.value_width, t.value_precision, b, t.ratio_width, ratio);
      result["ratios"][row.key] = ratio;
      if (row.target != RatioTable::kNoTarget) {
        const bool met = row.lower_is_better ? ratio <= row.target : ratio >= row.target;
        all_met = all_met && met;
        std::printf(" %*s%.2f %s", t.op_width, row.lower_is_better ? "<=" : ">=", row.target,
                    met ? "met" : "NOT MET");
        result["met"][row.key] = met;
      } else {
        std::printf(" %*s", t.op_width + 4, "-");
      }
    }
    std::printf("\n");
  }
  return all_met;
}

void finish_report(const std::string& json_file, const nlohmann::json& result, bool torch,
                   bool all_met) {
  if (!json_file.empty()) std::ofstream(json_file) << result.dump(2) << "\n";
  if (torch) std::printf("targets: %s\n", all_met ? "all met" : "not all met");
}

}  // namespace tdist::bench
