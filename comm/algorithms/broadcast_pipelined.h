#pragma once
// Chain broadcast, chunked and pipelined.
#include <cstddef>

#include "tdist/comm/algorithms/context.h"

namespace tdist::comm::algorithms {

// `bytes` of `data` from root to every rank, along a chain, chunked and pipelined. With `staging`
// (its buffer holds `data`): the root's data is being copied in as its pieces, and what it sends
// waits for them; every other rank finishes each chunk as it lands.
void broadcast_pipelined(Context& c, char* data, size_t bytes, int root,
                         Staging* staging = nullptr);

}  // namespace tdist::comm::algorithms
