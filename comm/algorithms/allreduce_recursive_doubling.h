#pragma once
// Recursive-doubling allreduce for small buffers.
#include <cstddef>

#include "tdist/comm/algorithms/context.h"

namespace tdist::comm::algorithms {

// In place. Latency-optimal for small buffers: log2(n) exchanges of the whole buffer;
// non-powers of two fold the extra ranks in first and send them the result last.
void allreduce_recursive_doubling(Context& c, char* data, size_t count, const ReduceSpec& rs);

}  // namespace tdist::comm::algorithms
