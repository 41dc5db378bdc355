#pragma once
// Plain types of the RPC API: worker identity, options, call targets and per-call timeouts.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "tdist/core/store.h"

namespace tdist::rpc {

using Clock = std::chrono::steady_clock;

// A worker of the RPC group: its unique name and its rank in [0, world_size).
struct WorkerInfo {
  std::string name;
  int rank = -1;

  bool operator==(const WorkerInfo& o) const { return rank == o.rank && name == o.name; }
  template <class Archive>
  void serialize(Archive& ar) {
    ar(name, rank);
  }
};

// Options of init_rpc (torch.distributed.rpc.TensorPipeRpcBackendOptions' names where they
// exist).
struct RpcOptions {
  static constexpr Millis kDefaultTimeout{60000};

  // How workers find each other: "env://", "tcp://host:port", "file:///path" (core/rendezvous.h).
  // Ignored when `store` is set.
  std::string init_method = "env://";
  // A store shared by all workers (e.g. a HashStore when workers are threads of one process).
  std::shared_ptr<Store> store;
  // Default timeout of every call, of to_here() and of shutdown's waits; 0 = none.
  Millis rpc_timeout = kDefaultTimeout;
  // Bounds each wait of a graceful shutdown (for the others to arrive, for local work to end).
  Millis shutdown_timeout{300000};
  // Threads that run incoming calls. Calls that block on nested RPCs hold a thread each.
  int num_worker_threads = 8;
  // The shared secret: every connection must pass an HMAC-SHA256 challenge keyed with it
  // (rpc/detail/auth.h) before any message is read; all workers must use the same one. Unset (the
  // default): TDIST_TOKEN or TDIST_TOKEN_FILE (core/token.h). Empty, set or loaded: no
  // authentication, and the agent logs one warning naming its port.
  std::optional<std::string> token;
  // Address this worker listens on and that it publishes to the others, used as given. Empty
  // (the default): the one the collective mesh picks (core/net/address.h local_address, toward
  // the store's host; TDIST_SOCKET_HOST or TDIST_SOCKET_IFNAME override it). Port 0: any free port.
  std::string listen_host;
  uint16_t listen_port = 0;
  // Largest frame (header, arguments and tensors of one message) accepted from a peer.
  uint64_t max_frame_bytes = uint64_t{4} << 30;
  // Same-host peers pass large tensors through shared memory (the sender copies a tensor into
  // a shared slot, the receiver uses it in place) or read them straight from the sender's
  // memory (Linux process_vm_readv) when the kernel allows it; off sends every byte through
  // the socket.
  bool same_host_fast_path = true;
  // Bytes of shared-memory slots one connection's sender may hold (rpc/detail/shm_tensors.h);
  // beyond it large tensors go by process_vm_readv. -1: TDIST_RPC_SHM_BYTES, else 256 MiB;
  // 0: never.
  int64_t shm_bytes = -1;
  // Bytes of the shared-memory ring that carries each direction's frames between the workers of
  // one host instead of TCP (rpc/detail/shm_stream.h); needs the same-host fast path.
  // -1: TDIST_RPC_STREAM_BYTES, else 256 KiB; 0: frames stay on TCP.
  int64_t stream_bytes = -1;
  // SO_SNDBUF and SO_RCVBUF of every connection in bytes (the kernel may round them); 0 keeps
  // the system's defaults. Small buffers make writers block early (tests use that).
  int socket_buffer_bytes = 0;
  // The whole handshake of a new connection (connect included on the connecting side), however
  // its bytes trickle. 0: TDIST_RPC_HANDSHAKE_TIMEOUT_MS, else min(rpc_timeout, 10 s).
  Millis handshake_timeout{0};
  // Accepted connections still in their handshake, at most; a new one beyond it closes the
  // oldest (so idle strangers cannot lock real peers out). 0: TDIST_RPC_MAX_PENDING_HANDSHAKES,
  // else 64.
  int max_pending_handshakes = 0;
  // Accepted connections open at once (in their handshake or authenticated), at most; beyond it
  // a new one is told busy (Note [RPC handshake]) and closed. 0: TDIST_RPC_MAX_CONNECTIONS,
  // else 1024.
  int max_connections = 0;
  // Authenticated connections from one worker at once, at most (a worker keeps one to each
  // peer; a few more cover reconnects); beyond it a new one is closed. 0:
  // TDIST_RPC_MAX_CONNECTIONS_PER_PEER, else 8.
  int max_connections_per_peer = 0;
  // Requests read from one connection whose handlers have not returned, at most; at the limit
  // the connection's reader stops reading until one returns (the peer's sends then wait on
  // TCP). Bounds the worker pool's queue to max_connections times this. 0:
  // TDIST_RPC_MAX_REQUESTS_IN_FLIGHT, else 1024.
  int max_requests_in_flight = 0;
  // Microseconds an idle worker thread keeps looking for the next incoming call (yielding the
  // core between looks) before it sleeps; one thread at a time. A small call then starts without
  // a thread wake-up. -1: TDIST_RPC_SPIN_US, else 50; 0: never.
  int spin_us = -1;
};

// Where a call goes: a worker name, a rank or a WorkerInfo.
class To {
 public:
  To(const std::string& name) : name_(name) {}      // NOLINT(runtime/explicit)
  To(const char* name) : name_(name) {}             // NOLINT(runtime/explicit)
  To(int rank) : rank_(rank) {}                     // NOLINT(runtime/explicit)
  To(const WorkerInfo& info) : rank_(info.rank) {}  // NOLINT(runtime/explicit)

  bool by_rank() const { return rank_ >= 0; }
  int rank() const { return rank_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  int rank_ = -1;
};

// A per-call timeout, passed right after the function name:
//   rpc_sync<int>("w1", "add", Timeout{Millis(500)}, 1, 2);
// Millis(0) waits without limit; a negative value (the default) uses RpcOptions::rpc_timeout.
struct Timeout {
  Millis value{-1};
};

// Identifies an RRef (created_on, local_id) or one user's fork of it.
struct GloballyUniqueId {
  int32_t created_on = -1;
  int64_t local_id = -1;

  bool operator==(const GloballyUniqueId& o) const {
    return created_on == o.created_on && local_id == o.local_id;
  }
  bool operator!=(const GloballyUniqueId& o) const { return !(*this == o); }
  bool operator<(const GloballyUniqueId& o) const {
    return created_on != o.created_on ? created_on < o.created_on : local_id < o.local_id;
  }
  std::string str() const;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(created_on, local_id);
  }
};
using RRefId = GloballyUniqueId;
using ForkId = GloballyUniqueId;

struct GloballyUniqueIdHash {
  size_t operator()(const GloballyUniqueId& id) const {
    return std::hash<int64_t>()(id.local_id) * 31 + std::hash<int32_t>()(id.created_on);
  }
};

}  // namespace tdist::rpc
