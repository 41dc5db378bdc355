#pragma once
// What RPC's own transport can do at best on this host, for benchmarks that print a bound beside
// a measured figure (tdist-bench rpc).
//
// Thread safety: each call is independent; it starts and joins a thread of its own.

#include <cstddef>
#include <vector>

namespace tdist::rpc {

// Round trips of `bytes` through two of the shared-memory rings that carry a connection's frames
// between workers of one host (Note [RPC shared-memory frame streams] in
// rpc/detail/shm_stream.h), one per direction, between the calling thread and an echo thread of
// this process; each side looks for its message as a connection's reader does between frames
// (no sleep, yielding the core between looks). Returns the seconds of each of `iters` round trips
// after `warmup` unmeasured ones. Error when the rings cannot be created or mapped.
std::vector<double> shm_ring_round_trips(size_t bytes, int warmup, int iters);

}  // namespace tdist::rpc
