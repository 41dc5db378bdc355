#pragma once
// The TCPStore server behind core/tcp_store.h's TCPStoreServer: it accepts connections
// (core/detail/tcp_store_connection.h) and bounds them (how many at once; handshake slots per
// address, Note [TCPStore protocol] in core/tcp_store.cpp, limits), grants the bytes of request
// bodies in flight from one budget, hands each request to the store's table
// (core/detail/tcp_store_table.h), and runs all of it on one Boost.Asio io_context on its own
// thread.
//
// Thread safety: constructed and destroyed by the owner; every other method runs on the io
// thread, so no connection state, no key and no waiter needs a lock. The counters are atomics
// that any thread may read. Destruction closes every connection and joins the io thread without
// blocking on any peer.

#include <boost/asio.hpp>

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>

#include "tdist/core/detail/tcp_store_connection.h"
#include "tdist/core/detail/tcp_store_table.h"
#include "tdist/core/net/address.h"
#include "tdist/core/tcp_store.h"
#include "tdist/core/wire.h"

namespace tdist::detail {

// TCPStoreServerOptions resolved: a field that is set wins, an unset one takes its TDIST_*
// variable, else the default (docs/configuration.md). resolve_server_limits is the only place
// the store's server reads the environment; InvalidArgument names the field or the variable
// whose value is out of range.
struct StoreServerLimits {
  size_t max_connections = 0;  // default: 3/4 of the descriptor limit, at least 64
  size_t max_keys = size_t{1} << 20;
  uint64_t max_bytes = uint64_t{4} << 30;
  Millis frame_timeout{60000};
  Millis handshake_timeout{10000};
  size_t max_handshakes_per_address = 16;
  uint64_t max_inflight_bytes = TCPStoreServer::kMaxFrameBytes;
  bool allow_no_token = false;
};
StoreServerLimits resolve_server_limits(const TCPStoreServerOptions& options);

class TCPStoreServerImpl {
 public:
  TCPStoreServerImpl(const std::string& host, uint16_t port, std::string token,
                     const StoreServerLimits& limits);
  ~TCPStoreServerImpl();

  uint16_t port() const { return port_; }
  const std::string& host() const { return host_; }
  int num_connections() const { return num_connections_.load(); }
  int64_t num_rejected_frames() const { return num_rejected_frames_.load(); }
  int64_t num_refused_connections() const { return num_refused_connections_.load(); }
  int64_t num_failed_handshakes() const { return num_failed_handshakes_.load(); }
  uint64_t peak_body_bytes() const { return peak_body_bytes_.load(); }
  std::string address() const { return net::host_port(host_, port_); }
  Millis frame_timeout() const { return frame_timeout_; }
  Millis handshake_timeout() const { return handshake_timeout_; }
  const std::string& token() const { return token_; }

  // Called by connections, on the io thread.
  void handle_request(const std::shared_ptr<TCPStoreConnection>& conn, uint16_t code,
                      wire::Reader& body);
  void on_rejected_frame() { num_rejected_frames_.fetch_add(1); }
  void on_connection_closed(TCPStoreConnection* conn);
  // Logs (the first ten, then one in a thousand) and counts a connection that failed the
  // handshake.
  void on_failed_handshake(const std::string& peer, const std::string& why);
  // The connection passed its handshake (or closed): its handshake slot is free.
  void on_handshake_over(TCPStoreConnection& conn);
  // Why a request with this (valid) header is refused before its body is read ("" when it is
  // not): a write that could not fit in what the store may still hold (the table's word), or a
  // body larger than the in-flight budget (Note [TCPStore protocol], limits).
  std::string refusal_before_body(const tcp_store::Header& header) const;
  // Takes `bytes` of the in-flight budget for conn's request body: true when granted now;
  // otherwise conn waits in line and its start_body() is called once the budget has room.
  bool reserve_body(const std::shared_ptr<TCPStoreConnection>& conn, uint64_t bytes);
  // Gives back a reservation (body dispatched or connection closed) and admits who waits.
  void release_body(uint64_t bytes);
  // A buffer whose contents nobody reads: the bodies of refused requests are read into it.
  Bytes& discard_buffer() { return discard_buffer_; }

 private:
  void run();
  void start_accept();
  void on_accept(const error_code& ec, tcp::socket socket);
  void on_accept_retry(const error_code& ec);
  void shutdown();
  // Closes a connection still in its handshake to make room for a new one, logged as a failed
  // handshake.
  void displace(TCPStoreConnection& conn, const std::string& why);

  // Constant after construction.
  std::string host_;
  uint16_t port_ = 0;
  std::string token_;  // of the connection handshake (empty: none)

  asio::io_context io_;
  tcp::acceptor acceptor_;
  asio::steady_timer accept_retry_timer_;  // paces accept after an error (e.g. out of fds)
  std::thread thread_;
  std::atomic<int> num_connections_{0};
  std::atomic<int64_t> num_rejected_frames_{0};
  std::atomic<int64_t> num_refused_connections_{0};
  std::atomic<int64_t> num_failed_handshakes_{0};
  size_t max_connections_ = 0;   // TDIST_STORE_MAX_CONNECTIONS, or from the descriptor limit
  Millis frame_timeout_{0};      // TDIST_STORE_FRAME_TIMEOUT_MS: a started frame must end by then
  Millis handshake_timeout_{0};  // TDIST_STORE_HANDSHAKE_TIMEOUT_MS: the handshake must end by then
  size_t max_handshakes_per_address_ = 0;     // TDIST_STORE_MAX_HANDSHAKES_PER_ADDRESS
  uint64_t max_body_bytes_in_flight_ = 0;     // TDIST_STORE_MAX_INFLIGHT_BYTES
  std::atomic<uint64_t> peak_body_bytes_{0};  // the most reserved at once
  Millis dead_peer_timeout_{0};               // TDIST_TCP_USER_TIMEOUT_MS (Note [Vanished hosts])

  // Touched only from the io thread.
  bool stopping_ = false;
  std::unique_ptr<StoreTable> table_;  // made once the port is known
  // Connections in their handshake, oldest first (by accept number), and how many per address.
  std::map<uint64_t, TCPStoreConnection*> handshakes_;
  std::unordered_map<std::string, size_t> handshakes_per_address_;
  uint64_t next_accept_number_ = 1;
  // Request bodies: bytes reserved now, and the connections waiting for room, first come first.
  uint64_t body_bytes_in_flight_ = 0;
  std::deque<std::shared_ptr<TCPStoreConnection>> waiting_for_budget_;
  Bytes discard_buffer_;
  std::set<std::shared_ptr<TCPStoreConnection>> connections_;
};

}  // namespace tdist::detail
