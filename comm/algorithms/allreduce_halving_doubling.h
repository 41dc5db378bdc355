#pragma once
// Halving-doubling allreduce (Rabenseifner's): a reduce-scatter by recursive halving, then an
// allgather by recursive doubling. Note [Halving-doubling] in allreduce_halving_doubling.cpp.
#include <cstddef>
#include <vector>

#include "tdist/comm/algorithms/context.h"

namespace tdist::comm::algorithms {

// One exchange of the algorithm on one rank, in elements of the buffer. The step sends
// [send_begin, send_begin + send_count) to `peer` and receives [recv_begin, recv_begin +
// recv_count) from it (reduced into the buffer when `reduce`, else copied), then waits for both:
// each step is one dependent round. A count of 0 moves nothing that way.
struct HalvingDoublingStep {
  int peer;
  size_t send_begin, send_count;
  size_t recv_begin, recv_count;
  bool reduce;
};

// The steps of rank `rank` of `size` for `count` elements: pure arithmetic, so that the
// algorithm's rounds and bytes can be counted at any world without running it (tests). With p
// the largest power of two <= size: 2 log2 p steps of (p-1)/p of the buffer in all each way on
// the p ranks that run the halving and doubling; a rank that folds in first (one of the 2 (size
// - p) lowest) adds one step of the whole buffer each side.
std::vector<HalvingDoublingStep> halving_doubling_plan(size_t count, int size, int rank);

// In place on `data` (count elements). The bytes of the ring (2 (n-1)/n of the buffer per rank at
// a power of two) in 2 log2 n dependent rounds instead of the ring's 2 (n-1) dependent hops.
// AVG: each rank divides the segment it completed, before the allgather (every rank ends with the
// same quotient).
void allreduce_halving_doubling(Context& c, char* data, size_t count, const ReduceSpec& rs);

}  // namespace tdist::comm::algorithms
