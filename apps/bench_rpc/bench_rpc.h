#pragma once
// tdist-bench-rpc: RPC latency and throughput, tdist against torch.distributed.rpc (TensorPipe)
// measured side by side in one run. See docs/perf.md ("RPC").

namespace tdist::bench {

// Parses the command line (CLI11) and runs the benchmark; returns the process exit code.
int run_rpc_bench(int argc, char** argv);

// tdist-bench rpc --autograd (bench_autograd.cpp): training over RPC with distributed autograd and
// the DistributedOptimizer, against torch.distributed.autograd. run_rpc_bench() hands over to it.
int run_autograd_bench(int argc, char** argv);

}  // namespace tdist::bench
