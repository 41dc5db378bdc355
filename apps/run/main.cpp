// tdist-run: a torchrun-like launcher.
//
//   tdist-run --nproc-per-node 4 [--nnodes N --node-rank R] [--master-addr A] [--master-port P]
//             [--standalone] [--max-restarts K] [--log-dir DIR [--tee 0-3]] PROGRAM ARGS...
//
// Exit codes: 0 all workers succeeded; 1 a worker failed (rank and exit code or signal are
// reported); 2 bad flags; 128+N stopped by signal N (forwarded to the workers).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>

#include "apps/run/launcher.h"
#include "tdist/core/error.h"

int main(int argc, char** argv) {
  tdist::run::LaunchConfig cfg;
  CLI::App app{"tdist-run: start one worker process per rank (torchrun's flags and variables)",
               "tdist-run"};
  app.prefix_command();  // everything from the program name on belongs to the program
  std::string endpoint;
  bool standalone = false;
  double monitor_interval_s = 0.1;
  double stop_grace_s = 5.0;
  bool no_tee = false;
  int tee = -1;
  app.add_option("--nproc-per-node,--nproc_per_node", cfg.nproc_per_node,
                 "worker processes on this node")
      ->check(CLI::Range(1, 4096));
  app.add_option("--nnodes", cfg.nnodes, "number of nodes")->check(CLI::Range(1, 65536));
  app.add_option("--node-rank,--node_rank", cfg.node_rank, "this node's rank")
      ->check(CLI::Range(0, 65535));
  app.add_option("--master-addr,--master_addr", cfg.master_addr, "address of rank 0's store");
  app.add_option("--master-port,--master_port", cfg.master_port,
                 "port of rank 0's store (0: pick a free one)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--rdzv-endpoint,--rdzv_endpoint", endpoint, "HOST:PORT of the store");
  app.add_flag("--standalone", standalone, "single node: local address and a free port");
  app.add_option("--max-restarts,--max_restarts", cfg.max_restarts,
                 "restart the whole group this many times after a failure")
      ->check(CLI::Range(0, 1000000));
  app.add_option("--monitor-interval,--monitor_interval", monitor_interval_s,
                 "seconds between checks of the workers")
      ->check(CLI::Range(0.001, 3600.0));
  app.add_option("--stop-grace", stop_grace_s,
                 "seconds between SIGTERM and SIGKILL when stopping workers")
      ->check(CLI::Range(0.0, 3600.0));
  app.add_option("--log-dir,--log_dir", cfg.log_dir,
                 "write each rank's stdout and stderr to DIR/attempt_<n>/rank_<r>.{stdout,stderr}");
  app.add_option("--tee", tee,
                 "with --log-dir, also print these worker streams: 0 none, 1 stdout, 2 stderr, "
                 "3 both (default)")
      ->check(CLI::Range(0, 3));
  app.add_flag("--no-tee", no_tee, "with --log-dir: do not also print worker output (--tee 0)");
  try {
    app.parse(argc, argv);
    cfg.command = app.remaining();
    if (cfg.command.empty()) throw CLI::ValidationError("PROGRAM", "no program to launch given");
    if (cfg.command[0].size() > 1 && cfg.command[0][0] == '-') {
      throw CLI::ExtrasError("unknown option " + cfg.command[0], CLI::ExitCodes::ExtrasError);
    }
    if (!endpoint.empty()) {
      auto colon = endpoint.rfind(':');
      if (colon == std::string::npos || colon == 0)
        throw CLI::ValidationError("--rdzv-endpoint", "'" + endpoint + "' is not HOST:PORT");
      cfg.master_addr = endpoint.substr(0, colon);
      std::string port = endpoint.substr(colon + 1);
      try {
        size_t used = 0;
        int p = std::stoi(port, &used);
        if (used != port.size() || p < 1 || p > 65535) throw std::out_of_range(port);
        cfg.master_port = p;
      } catch (const std::exception&) {
        throw CLI::ValidationError("--rdzv-endpoint", "port '" + port + "' is not in [1, 65535]");
      }
    }
    if (standalone) {
      if (cfg.nnodes != 1) throw CLI::ValidationError("--standalone", "needs --nnodes 1");
      cfg.master_addr = "127.0.0.1";
      cfg.master_port = 0;
    }
    if (cfg.node_rank >= cfg.nnodes) {
      throw CLI::ValidationError("--node-rank", std::to_string(cfg.node_rank) +
                                                    " is out of range for --nnodes " +
                                                    std::to_string(cfg.nnodes));
    }
    if (no_tee && cfg.log_dir.empty()) throw CLI::ValidationError("--no-tee", "needs --log-dir");
    if (tee >= 0 && cfg.log_dir.empty()) throw CLI::ValidationError("--tee", "needs --log-dir");
    if (no_tee && tee > 0) throw CLI::ValidationError("--no-tee", "contradicts --tee " + std::to_string(tee));
    cfg.tee = no_tee ? 0 : tee >= 0 ? tee : tdist::run::kTeeStdout | tdist::run::kTeeStderr;
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "tdist-run: " << e.what() << "\nRun with --help for usage.\n";
    return 2;
  }
  cfg.monitor_interval = std::chrono::milliseconds(static_cast<int64_t>(monitor_interval_s * 1000));
  cfg.stop_grace = std::chrono::milliseconds(static_cast<int64_t>(stop_grace_s * 1000));
  try {
    tdist::run::Launcher launcher(cfg);
    return launcher.run();
  } catch (const tdist::InvalidArgument& e) {
    std::cerr << "tdist-run: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "tdist-run: " << e.what() << "\n";
    return 1;
  }
}
