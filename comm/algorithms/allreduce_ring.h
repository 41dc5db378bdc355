#pragma once
// Ring allreduce (Note [Streaming ring] in allreduce_ring.cpp) and its two phases.
#include <cstddef>
#include <vector>

#include "tdist/comm/algorithms/context.h"

namespace tdist::comm::algorithms {

// The ring allreduce's two phases over `ring` (Note [Streaming ring]), in place on `data` (count
// elements, split into ring.size segments: segment g = [count*g/size, count*(g+1)/size)).
// kReduceScatter leaves segment (me+1) % size fully reduced at position `me` (the rest is
// partial); kAllgather starts from that state and sends each position's segment to all.
// With `staging` (kBoth only) reads wait for the buffer's pieces and final chunks are finished.
// With `average_over` > 0 (kBoth only) the rank that completes a segment's sum divides each of
// its chunks by it before the allgather sends them, so every segment is divided once, by one
// rank, and every rank ends with the same quotient.
enum class RingPhases { kBoth, kReduceScatter, kAllgather };
void ring_phases(Context& c, const RingView& ring, char* data, size_t count, const ReduceSpec& rs,
                 RingPhases phases, Staging* staging = nullptr, int average_over = 0);
inline size_t ring_segment_begin(size_t count, int segment, int size) {
  return count * static_cast<size_t>(segment) / static_cast<size_t>(size);
}

// The pieces of a ring allreduce's buffer (count elements of elem bytes, world size, this rank) in
// the order it reads them: segment rank, rank - 1, ..., rank + 1, each cut into pieces of at most
// piece_bytes (whole elements).
std::vector<ByteRange> ring_allreduce_pieces(size_t count, size_t elem, int size, int rank,
                                             size_t piece_bytes);

// In place on `data` (count elements). Bandwidth-optimal: reduce-scatter then allgather around
// the ring, chunked so that chunk k is reduced and forwarded while chunk k+1 is in flight.
// With `staging` (world size > 1) the buffer is still being copied in, in the order of
// ring_allreduce_pieces, and every part whose values are final is handed to it.
void allreduce_ring(Context& c, char* data, size_t count, const ReduceSpec& rs,
                    Staging* staging = nullptr);

}  // namespace tdist::comm::algorithms
