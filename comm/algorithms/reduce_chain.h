#pragma once
// Chain reduce, chunked and pipelined.
#include <cstddef>

#include "tdist/comm/algorithms/context.h"

namespace tdist::comm::algorithms {

// Reduces every rank's `input` into `output` on root along a chain ending at root, chunked and
// pipelined. `output` is used on root only (it may alias `input`); non-root inputs are unchanged.
// With `staging` (world size > 1; the input is being copied in as its pieces, and on the root the
// output is the input) reads wait for the pieces and the root finishes each chunk once reduced.
void reduce_chain(Context& c, const char* input, char* output, size_t count, const ReduceSpec& rs,
                  int root, Staging* staging = nullptr);

}  // namespace tdist::comm::algorithms
