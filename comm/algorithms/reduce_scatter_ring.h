#pragma once
// Ring reduce-scatter.
#include <cstddef>
#include <vector>

#include "tdist/comm/algorithms/context.h"

namespace tdist::comm::algorithms {

// The pieces of a ring reduce-scatter's inputs (size blocks of count elements of elem bytes,
// block b at byte b * count * elem) in the order reduce_scatter_ring reads them with
// `chunk_bytes` chunks: round by round (as many rounds per piece as fit in piece_bytes), block
// rank - 1, rank - 2, ..., rank in each; at world 2 block rank + 1 whole first (it is sent at
// once).
std::vector<ByteRange> reduce_scatter_pieces(size_t count, size_t elem, int size, int rank,
                                             size_t chunk_bytes, size_t piece_bytes);

// output = reduction over ranks of inputs[rank] (count elements per block), around the ring.
// With `staging` (world size > 1; the inputs lie in its buffer, in the order of
// reduce_scatter_pieces) reads wait for the inputs' pieces.
void reduce_scatter_ring(Context& c, const std::vector<const char*>& inputs, char* output,
                         size_t count, const ReduceSpec& rs, Staging* staging = nullptr);

// For tests: the largest scratch request (bytes) reduce_scatter_ring made in this process since
// the last reset (every group and rank together).
size_t reduce_scatter_peak_scratch_bytes();
void reset_reduce_scatter_peak_scratch_bytes();

}  // namespace tdist::comm::algorithms
