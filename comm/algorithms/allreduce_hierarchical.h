#pragma once
// Hierarchical allreduce: inside each host, then across hosts.
#include <cstddef>
#include <vector>

#include "tdist/comm/algorithms/context.h"

namespace tdist::comm::algorithms {

// Ranks grouped by host (Note [Hierarchical allreduce]): every host has local.size() ranks.
struct Hierarchy {
  std::vector<int> local;  // this host's ranks, ascending
  std::vector<int> cross;  // the rank at this rank's local position on every host, by host
  int local_index = 0;     // this rank's position in `local`
  int host_index = 0;      // this host's position in `cross`
};
// In place: reduce-scatter inside each host, allreduce of each segment across hosts, allgather
// inside each host. Bit-identical results on every rank, like allreduce_ring.
void allreduce_hierarchical(Context& c, const Hierarchy& h, char* data, size_t count,
                            const ReduceSpec& rs);

}  // namespace tdist::comm::algorithms
