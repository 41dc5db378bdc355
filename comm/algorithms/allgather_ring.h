#pragma once
// Ring allgather.
#include <cstddef>
#include <vector>

#include "tdist/comm/algorithms/context.h"

namespace tdist::comm::algorithms {

// blocks[i] (block_bytes each) receives rank i's block; blocks[rank] holds this rank's, or, with
// `staging` (the blocks lie in its buffer), is being copied in as its pieces: what leaves it
// waits for them. With `staging` every received part is finished as it lands (this rank's own
// block is the caller's to finish).
void allgather_ring(Context& c, const std::vector<char*>& blocks, size_t block_bytes,
                    Staging* staging = nullptr);

}  // namespace tdist::comm::algorithms
