#include "tdist/rpc/detail/options.h"

#include <algorithm>
#include <cstdint>

#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/rpc/detail/shm_stream.h"

namespace tdist::rpc::detail {
namespace {

constexpr Millis kDefaultHandshakeTimeout{10000};
constexpr int64_t kDefaultMaxPendingHandshakes = 64;
constexpr int64_t kDefaultMaxConnections = 1024;
constexpr int64_t kDefaultMaxConnectionsPerPeer = 8;
constexpr int64_t kDefaultMaxRequestsInFlight = 1024;
constexpr int64_t kDefaultSpinUs = 50;  // Note [RPC waits spin first] in rpc/agent.cpp
constexpr int64_t kDefaultShmBytes = int64_t{256} << 20;  // Note [RPC shared-memory slots]
// Note [RPC shared-memory frame streams]
constexpr int64_t kDefaultStreamBytes = int64_t{256} << 10;

}  // namespace

RpcOptions resolve_options(RpcOptions o) {
  TDIST_CHECK_ARG(o.num_worker_threads > 0, "num_worker_threads must be positive, got ",
                  o.num_worker_threads);
  TDIST_CHECK_ARG(o.rpc_timeout.count() >= 0, "rpc_timeout must not be negative");
  TDIST_CHECK_ARG(o.handshake_timeout.count() >= 0, "handshake_timeout must not be negative");
  TDIST_CHECK_ARG(o.max_pending_handshakes >= 0, "max_pending_handshakes must not be negative");
  if (o.handshake_timeout.count() == 0) {
    const Millis fallback = o.rpc_timeout.count() > 0
                                ? std::min(o.rpc_timeout, kDefaultHandshakeTimeout)
                                : kDefaultHandshakeTimeout;
    o.handshake_timeout =
        Millis(env::get_int("TDIST_RPC_HANDSHAKE_TIMEOUT_MS", fallback.count(), 1, INT32_MAX));
  }
  if (o.max_pending_handshakes == 0) {
    o.max_pending_handshakes = static_cast<int>(
        env::get_int("TDIST_RPC_MAX_PENDING_HANDSHAKES", kDefaultMaxPendingHandshakes, 1, 1 << 20));
  }
  TDIST_CHECK_ARG(
      o.max_connections >= 0 && o.max_connections_per_peer >= 0 && o.max_requests_in_flight >= 0,
      "max_connections, max_connections_per_peer and max_requests_in_flight must "
      "not be negative (0: the default)");
  if (o.max_connections == 0) {
    o.max_connections = static_cast<int>(
        env::get_int("TDIST_RPC_MAX_CONNECTIONS", kDefaultMaxConnections, 1, 1 << 20));
  }
  if (o.max_connections_per_peer == 0) {
    o.max_connections_per_peer = static_cast<int>(env::get_int(
        "TDIST_RPC_MAX_CONNECTIONS_PER_PEER", kDefaultMaxConnectionsPerPeer, 1, 1 << 20));
  }
  if (o.max_requests_in_flight == 0) {
    o.max_requests_in_flight = static_cast<int>(
        env::get_int("TDIST_RPC_MAX_REQUESTS_IN_FLIGHT", kDefaultMaxRequestsInFlight, 1, 1 << 24));
  }
  TDIST_CHECK_ARG(o.spin_us >= -1, "spin_us must be -1 (the default) or more, got ", o.spin_us);
  if (o.spin_us == -1) {
    o.spin_us = static_cast<int>(env::get_int("TDIST_RPC_SPIN_US", kDefaultSpinUs, 0, 1000000));
  }
  TDIST_CHECK_ARG(o.shm_bytes >= -1, "shm_bytes must be -1 (the default) or more, got ",
                  o.shm_bytes);
  if (o.shm_bytes == -1) {
    o.shm_bytes = env::get_int("TDIST_RPC_SHM_BYTES", kDefaultShmBytes, 0, INT64_MAX);
  }
  TDIST_CHECK_ARG(o.stream_bytes == -1 || o.stream_bytes == 0 ||
                      (o.stream_bytes >= static_cast<int64_t>(kMinStreamBytes) &&
                       o.stream_bytes <= static_cast<int64_t>(kMaxStreamBytes)),
                  "stream_bytes must be -1 (the default), 0 (off) or from ", kMinStreamBytes,
                  " to ", kMaxStreamBytes, ", got ", o.stream_bytes);
  if (o.stream_bytes == -1) {
    const int64_t bytes = env::get_int("TDIST_RPC_STREAM_BYTES", kDefaultStreamBytes, 0,
                                       static_cast<int64_t>(kMaxStreamBytes));
    o.stream_bytes = bytes == 0 ? 0 : std::max<int64_t>(bytes, kMinStreamBytes);
  }
  return o;
}

}  // namespace tdist::rpc::detail
