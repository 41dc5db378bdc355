#pragma once
// tdist-bench-ddp: training throughput of tdist's DistributedDataParallel, measured side by side
// with plain libtorch (world size 1) and with PyTorch's Python DDP over gloo (world size N,
// scripts/bench_ddp_torch.py) on the same model, batch and world size. Reports samples/s and
// the ratios. Meant to become `tdist-bench ddp`.

namespace tdist::bench {

// The whole program (argument parsing included); returns the process exit code.
int run_ddp_bench(int argc, char** argv);

}  // namespace tdist::bench
