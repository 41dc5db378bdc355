// tdist-bench: benchmarks a user runs, one subcommand per file (see subcommands.h). `ddp` and
// `rpc` start their own processes and take their own flags (tdist-bench ddp --help). Exit
// status: 0, 1 when a run fails, 2 for a bad flag or flag value.
#include <CLI/CLI.hpp>

#include <cstring>
#include <iostream>

#include "apps/bench/subcommands.h"
#include "tdist/core/error.h"

namespace {

struct SelfContained {
  const char* name;
  const char* help;
  int (*run)(int argc, char** argv);
};

const SelfContained kSelfContained[] = {
    {"ddp", "DDP training throughput: tdist vs plain libtorch and PyTorch's DDP over gloo",
     tdist::bench::run_ddp_bench},
    {"rpc", "RPC latency, call rate and tensor echo: tdist vs torch.distributed.rpc",
     tdist::bench::run_rpc_bench},
    {"net",
     "the I/O models (POSIX, poll, Boost.Asio) on the traffic of the mesh, RPC and the store",
     tdist::bench::run_net_bench},
    {"pipeline", "pipeline schedules: samples/s and measured vs analytic bubble",
     tdist::bench::run_pipeline_bench},
    {"fsdp", "sharded data parallel: tdist fsdp and DDP vs PyTorch FSDP2 and DDP (GPT, Adam, CPU)",
     tdist::bench::run_fsdp_bench},
};

}  // namespace

int main(int argc, char** argv) {
  // Self-contained benchmarks parse their own flags (argv[0] becomes the subcommand's name).
  if (argc >= 2) {
    for (const auto& b : kSelfContained) {
      if (std::strcmp(argv[1], b.name) == 0) return b.run(argc - 1, argv + 1);
    }
  }
  CLI::App app{"tdist-bench: benchmarks of tdist", "tdist-bench"};
  app.require_subcommand(1);
  tdist::bench::add_collective_command(app);
  for (const auto& b : kSelfContained) app.add_subcommand(b.name, b.help)->allow_extras();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help: 0; a bad flag or value: 2, as the others
  } catch (const tdist::InvalidArgument& e) {
    std::cerr << "tdist-bench: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "tdist-bench: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
