#pragma once
// The anchors of `tdist-bench collective --anchor mpi|gloo`: the same collective over the same
// sizes through another library, on this host, with as many processes as the tdist run has
// ranks, run by rank 0 while the other ranks wait (idle) in the store.
//   mpi   Open MPI: tdist-bench-mpi (mpi_collective.c, built beside tdist-bench when CMake found
//         MPI) under `mpirun --oversubscribe --allow-run-as-root -np N`
//   gloo  torch.distributed's Gloo: `python scripts/bench_gloo.py --worker`, N processes
// Both: float32, sum, the timing rule of tdist-bench collective (per iteration the slowest
// rank, median over the iterations).

#include <cstddef>
#include <string>
#include <vector>

namespace tdist::bench {

struct AnchorRun {
  std::string anchor;  // "mpi" or "gloo"
  std::string op;
  int world = 2;
  int warmup = 5;
  int iters = 20;
  // The rows of the tdist run: min_bytes, max_bytes and step_factor as given (bench_gloo.py
  // derives the same sizes from them), `bytes` as measured.
  std::string min_bytes, max_bytes;
  double step_factor = 2;
  std::vector<size_t> bytes;
  std::string python = "python3";
};

// Throws InvalidArgument when `anchor` cannot measure this run (not float32 and sum), and
// std::runtime_error naming what is missing (mpirun not in PATH, tdist-bench-mpi not built,
// bench_gloo.py not found). Cheap; call it before the tdist run.
void check_anchor(const std::string& anchor, const std::string& dtype, const std::string& redop);

// The anchor's time in microseconds per entry of run.bytes; std::runtime_error with the
// anchor's output when it fails or reports other sizes.
std::vector<double> run_anchor(const AnchorRun& run);

}  // namespace tdist::bench
