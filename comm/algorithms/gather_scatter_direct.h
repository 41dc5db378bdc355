#pragma once
// Gather and scatter straight between the root and every rank.
#include <cstddef>
#include <vector>

#include "tdist/comm/algorithms/context.h"

namespace tdist::comm::algorithms {

// Root: blocks[i] receives rank i's `input` (blocks[root] is filled by the caller). With
// `staging` (its buffer holds the input, or on the root the blocks): what a rank sends waits for
// its pieces, and the root finishes every other block chunk by chunk as it lands (its own is the
// caller's to finish).
void gather_direct(Context& c, const char* input, const std::vector<char*>& blocks,
                   size_t block_bytes, int root, Staging* staging = nullptr);
// Root sends blocks[i] to rank i; every non-root receives into `output`. With `staging` as for
// gather_direct, the other way round: the root's sends wait for the blocks' pieces, every
// non-root finishes its output chunk by chunk.
void scatter_direct(Context& c, const std::vector<const char*>& blocks, char* output,
                    size_t block_bytes, int root, Staging* staging = nullptr);

}  // namespace tdist::comm::algorithms
