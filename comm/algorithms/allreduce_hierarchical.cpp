// Hierarchical allreduce: rings inside each host, a ring across hosts per segment.
//
// Note [Hierarchical allreduce]
//   With H hosts of L ranks each, the flat ring crosses between hosts at least H times, and each
//   crossing carries 2(n-1)/n of the buffer (n = H*L), all through the hosts' links, which are
//   much slower than shared memory. Here the ranks of a host first reduce-scatter the buffer
//   among themselves (L segments; shared memory), so local position i holds its host's sum of
//   segment (i+1) % L; then the L ranks that hold the same segment on the H hosts (position i on
//   every host) allreduce it with a ring of their own, in parallel, over their TCP connections;
//   then each host allgathers its segments. Each host's link carries 2(H-1)/H of the buffer in
//   all, the least any allreduce can send (the benchmark's link bound), split over L
//   connections. Every segment is reduced in one order (its local rings, then its cross-host
//   ring, then copied), so every rank ends with the same bits. The process group uses it above
//   the small-message size when every host has the same number of ranks, at least two, and there
//   are at least two hosts (ring_process_group.cpp); otherwise the flat algorithms run.

#include "tdist/comm/algorithms/allreduce_hierarchical.h"
#include "tdist/comm/algorithms/allreduce_ring.h"

namespace tdist::comm::algorithms {

void allreduce_hierarchical(Context& c, const Hierarchy& h, char* data, size_t count,
                            const ReduceSpec& rs) {
  const int local_size = static_cast<int>(h.local.size());
  const RingView local{h.local.data(), local_size, h.local_index};
  const RingView cross{h.cross.data(), static_cast<int>(h.cross.size()), h.host_index};
  ring_phases(c, local, data, count, rs, RingPhases::kReduceScatter);
  const int g = (h.local_index + 1) % local_size;
  const size_t begin = ring_segment_begin(count, g, local_size);
  const size_t end = ring_segment_begin(count, g + 1, local_size);
  // An average: the cross rings divide their segments by the group's size.
  ring_phases(c, cross, data + begin * rs.elem_size, end - begin, rs, RingPhases::kBoth, nullptr,
              rs.op == ReduceOp::AVG ? c.size : 0);
  ring_phases(c, local, data, count, rs, RingPhases::kAllgather);
}

}  // namespace tdist::comm::algorithms
