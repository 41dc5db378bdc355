#pragma once
// The collective channels of a group: to every peer, a shared-memory channel when the two
// ranks are on one host (same host key, below) and can map one segment (shared memory available,
// allowed on both sides), otherwise the TCP connection itself. Every rank also learns every
// peer's host key, from which the group finds its hosts (the hierarchical allreduce).
//
// Note [Host key]
//   Two ranks are on one host when they run on the same kernel instance (its boot id) in the
//   same network namespace. The boot id alone is not enough: "hosts" made of network namespaces
//   (tests, containers) share the kernel and usually /dev/shm, yet their traffic between each
//   other crosses a (virtual) link like real hosts', and that is what the algorithms must see.
//   ProcessGroup::Options::host or TDIST_HOST_ID replace the key (ranks with equal keys are one
//   host).
//
// Note [Shared-memory negotiation]
//   Runs once on each pair's collective TCP connection, right after the mesh is built and
//   before any collective byte. The lower rank creates a segment under a fresh random name and
//   sends  u32 magic 'TDSH' | u64 ring capacity | u32 name length | name  (length 0: no offer,
//   because it is disallowed or creation failed) | u32 host key length | host key | process.
//   The higher rank opens and maps it and answers one byte: 1 accepted, 0 refused, then its own
//   host key and process. `process` is u32 pid | u64 canary address | u64 canary value
//   (core/process_memory.h): each side checks whether it can read the other's memory (Note
//   [Single-copy collectives] in comm/algorithms/algorithms.h). The lower rank unlinks the name
//   after the answer (so no name outlives the setup, even if a rank dies later). Both then use
//   shared memory if and only if the answer was 1. Writes are tiny and never block, and every
//   rank first writes all its offers, then answers the lower ranks, then reads its answers, so
//   no rank waits in a cycle.
//
// Thread safety: called once by the thread that creates the group.

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "tdist/comm/transport/channel.h"
#include "tdist/comm/transport/tcp/mesh.h"

namespace tdist::comm {

// This process's host key: TDIST_HOST_ID when set, else the boot id and the network namespace
// (Note [Host key]).
std::string host_key();

struct ChannelOptions {
  bool allow_shm = true;       // TDIST_TRANSPORT != "tcp"
  // Bytes per direction (TDIST_SHM_BYTES). 2 MiB rather than 4: what a sender writes is more
  // often still in the caches when its peer reads it (docs/perf.md, "Ring size").
  size_t shm_capacity = 2 << 20;
  std::string host = host_key();  // this rank's host key (Note [Host key]); at most 255 bytes
};

struct Channels {
  std::vector<std::unique_ptr<Channel>> peers;  // by rank; nullptr at this rank
  std::vector<std::string> hosts;               // every rank's host key, this rank's included
  // By rank: the pid of a shared-memory peer whose memory this process can read (checked on
  // its canary), else 0.
  std::vector<pid_t> readable_pids;
};

// Blocks until negotiated or the deadline.
Channels make_channels(tcp::Mesh& mesh, int channel, const ChannelOptions& opts,
                       std::chrono::steady_clock::time_point deadline);

}  // namespace tdist::comm
