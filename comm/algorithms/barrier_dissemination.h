#pragma once
// Dissemination barrier.
#include "tdist/comm/algorithms/context.h"

namespace tdist::comm::algorithms {

// ceil(log2(n)) rounds of one byte each.
void barrier_dissemination(Context& c);

}  // namespace tdist::comm::algorithms
