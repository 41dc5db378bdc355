#pragma once
// The subcommands of tdist-bench, one file each (main.cpp wires them up):
//   collective  (collective.cpp)  an nccl-tests-style table for one collective (under tdist-run)
//   ddp         (ddp.cpp)         DDP samples/s vs plain libtorch and PyTorch's Python DDP
//   rpc         (rpc.cpp)         RPC round trip, async rate, tensor echo vs torch.distributed.rpc
//   rpc --autograd (autograd.cpp) training over RPC with distributed autograd and the
//                                 DistributedOptimizer vs torch.distributed.autograd
//   net         (net.cpp)         POSIX, poll and Boost.Asio I/O on each stack's traffic
//   pipeline    (pipeline.cpp)    a pipeline's samples/s and measured vs analytic bubble
//   fsdp        (fsdp.cpp)        tdist fsdp and DDP (tdist-train) vs PyTorch FSDP2 and DDP
// What they share is in common.h (all) and two_workers.h (rpc and autograd).
#include <CLI/CLI.hpp>

namespace tdist::bench {

// Adds the `collective` subcommand to `app`; it runs when the subcommand was parsed.
void add_collective_command(CLI::App& app);

// `ddp`, `rpc` and `rpc --autograd` parse their own command line (argv[0] is the subcommand's
// name) and start their own processes; each returns the process exit code.
int run_ddp_bench(int argc, char** argv);
// Hands over to run_autograd_bench() when --autograd is among the arguments.
int run_rpc_bench(int argc, char** argv);
int run_autograd_bench(int argc, char** argv);
int run_net_bench(int argc, char** argv);
int run_pipeline_bench(int argc, char** argv);
int run_fsdp_bench(int argc, char** argv);

}  // namespace tdist::bench
