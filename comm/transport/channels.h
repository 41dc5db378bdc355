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
//   Runs once on each pair's collective TCP connection, right after the mesh is built (whose
//   handshake checked the job's token, when there is one) and before any collective byte. Five steps, every rank
//   doing each for all its peers before the next, so that no rank waits in a cycle:
//   1. The lower rank creates a segment (a memfd sealed against resizing, mode 0600) and a local
//      link (comm/transport/shm/local_link.h: a Unix socket listening on a fresh random abstract
//      name), and sends  u32 magic 'TDS2' | u64 ring capacity | u32 name length | name | 32-byte
//      random nonce | u32 host key length | host key  (name length 0, no nonce: no offer,
//      because it is disallowed or no shared memory could be had).
//   2. The higher rank takes an offer from its own host (same host key) whose capacity is at
//      most its own (no peer makes it map and populate more than it agreed to): it connects to
//      the link and writes the hello  nonce | u32 lower rank | u32 higher rank | u64 group.
//      It answers on TCP  u8 connected | u32 host key length | host key.
//   3. The lower rank, told "connected", takes the link connection that brought exactly that
//      hello (queued by then; a stranger's connection is closed) and asks the kernel who holds it
//      (SO_PEERCRED): a process of our effective uid gets the same hello back with the segment's
//      descriptor attached (SCM_RIGHTS). It sends on TCP  u8 sent.
//   4. The higher rank, told "sent", reads the link: the hello it wrote (so the link is the one
//      this very lower rank made for this pair: a peer cannot relay another pair's link), one
//      descriptor, and from the kernel the listener's process, which must run as our uid. The
//      segment is mapped only when it is a regular file of our uid with mode 0600 (or narrower),
//      exactly the agreed size, and sealed (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL: its
//      creator cannot shrink it under our mapping into a SIGBUS). It sends on TCP  u8 mapped.
//   5. The lower rank reads "mapped". Both use shared memory if and only if it is 1.
//   Nothing about a process travels on the wire: each side's idea of the peer's process is the
//   kernel's (SO_PEERCRED). It may read that process's memory (Note [Single-copy collectives] in
//   comm/algorithms/single_copy.h) only when the kernel lets it and the process is not its own:
//   ranks that are threads of one process share memory rings but never single copies, and a
//   link that leads back to our own process gives no one a way to aim our copies at ourselves.
//   Ranks in different network namespaces cannot reach each other's link (the abstract
//   namespace is per network namespace) and use TCP, even when TDIST_HOST_ID calls them one
//   host.
//   No segment has a name, so none can be opened, replaced or left behind by anyone, and every
//   link socket and descriptor is closed when the negotiation ends. The link is never waited
//   on: its bytes are written before the TCP byte that announces them.
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
  bool allow_shm = true;  // TDIST_TRANSPORT != "tcp"
  // Bytes per direction (TDIST_SHM_BYTES). 2 MiB rather than 4: what a sender writes is more
  // often still in the caches when its peer reads it (docs/perf-history.md, "Ring size").
  size_t shm_capacity = 2 << 20;
  std::string host = host_key();  // this rank's host key (Note [Host key]); at most 255 bytes
  uint64_t group = 0;  // the group's id (tcp::fnv1a of its store prefix), in the link's hello
};

struct Channels {
  std::vector<std::unique_ptr<Channel>> peers;  // by rank; nullptr at this rank
  std::vector<std::string> hosts;               // every rank's host key, this rank's included
  // By rank: the pid of a shared-memory peer whose memory this process can read, as the kernel
  // names it (never this process's own), else 0.
  std::vector<pid_t> readable_pids;
};

// Blocks until negotiated or the deadline.
Channels make_channels(tcp::Mesh& mesh, int channel, const ChannelOptions& opts,
                       std::chrono::steady_clock::time_point deadline);

}  // namespace tdist::comm
