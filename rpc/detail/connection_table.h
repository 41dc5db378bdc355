#pragma once
// ConnectionTable: every connection of one agent, and which peers are reachable.
//
// - listen(): one listening socket (core/net/address.h Listener) at host:port (port 0 picks one;
//   port() tells which). The accept thread (start_accepting) hands every accepted socket to a
//   Connection, which runs the server side of the handshake on its reader thread
//   (rpc/detail/auth.h); finished incoming connections are reaped on the next accept. At most
//   max_pending_handshakes accepted connections are in their handshake: a new one closes the
//   oldest whose HELLO has not verified (telling it to retry, Note [RPC handshake]); beyond
//   max_connections the newest is told busy before it costs a thread; check_authenticated()
//   refuses a peer past max_connections_per_peer.
// - connection_to(rank, deadline): the one outgoing connection to a peer, made on first use
//   (net::connect_once: IPv4, IPv6 or a host name, each address it resolves to in turn). A
//   connect or handshake that fails is retried with backoff (10 ms doubling to 1 s) until the
//   deadline, except a refused handshake (ProtocolError: another token), which fails at once;
//   a busy server (Note [RPC handshake]) is retried.
// - A peer counts as failed only once an established connection to it (one that brought a
//   frame) is lost: later calls to it fail at once with NetworkError naming the peer and the
//   reason. A connection that closes before its first frame was never established: the next
//   call connects again. Every peer whose connection broke is remembered (lost_peers(), for
//   Note [RPC graceful shutdown]).
// - close_all() (stopping): no more accepts or connects; every connection closed and joined.
//
// Locking: conns_mu_ guards incoming_ and handshaking_; each peer's slot has its own mutex,
// held while connecting to it (one connect per peer at a time); lost_mu_ guards lost_. No two
// of them are held together.

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tdist/core/net/address.h"
#include "tdist/rpc/detail/connection.h"
#include "tdist/rpc/detail/membership.h"
#include "tdist/rpc/types.h"

namespace tdist::rpc::detail {

struct ConnectionLimits {
  int max_pending_handshakes = 0;
  int max_connections = 0;
  int max_connections_per_peer = 0;
};

class ConnectionTable {
 public:
  // `members` names the peers and gives their addresses; `handler` and `executor` serve every
  // connection made here. All must outlive the table's connections (close_all).
  ConnectionTable(int world_size, const Membership& members, ConnectionOptions options,
                  ConnectionLimits limits, ConnectionHandler* handler, Executor* executor);
  ~ConnectionTable();
  ConnectionTable(const ConnectionTable&) = delete;
  ConnectionTable& operator=(const ConnectionTable&) = delete;

  // Binds the listener (NetworkError naming this worker); then start_accepting() runs the
  // accept thread.
  void listen(const std::string& host, int port);
  void start_accepting();
  uint16_t port() const { return port_; }
  const ConnectionOptions& options() const { return options_; }

  // The established connection to `rank`, or a new one (see above). NetworkError when the peer
  // failed or cannot be reached by `deadline`; ProtocolError when it refused the handshake;
  // Error once stopping.
  std::shared_ptr<Connection> connection_to(int rank, Clock::time_point deadline);

  // An incoming connection passed its handshake: non-empty when its peer has too many open.
  std::string check_authenticated(const std::shared_ptr<Connection>& conn);
  // A connection closed (reader thread): records the loss; true when it was an outgoing
  // connection to a peer (the calls pending on it are to fail).
  bool on_closed(const std::shared_ptr<Connection>& conn, const std::string& reason);
  std::vector<int> lost_peers() const;

  // Stopping, in two steps: begin_stop() ends accepts and connect retries at once;
  // close_all() shuts the listener, joins the accept thread, marks every peer failed with
  // `reason`, and closes and joins every connection; release() (after the worker pool stopped)
  // drops them.
  void begin_stop() { stopped_ = true; }
  void close_all(const std::string& reason);
  void release();

 private:
  struct Peer {
    std::mutex mu;
    std::shared_ptr<Connection> conn;  // guarded by mu
    std::string failed;                // guarded by mu: why the peer is unreachable
  };

  void accept_loop();
  std::shared_ptr<Connection> connect(int rank, Millis timeout);

  // Constant after construction (port_ after listen()).
  const Membership& members_;
  const ConnectionOptions options_;
  const ConnectionLimits limits_;
  ConnectionHandler* const handler_;
  Executor* const executor_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::unique_ptr<net::Listener> listener_;
  uint16_t port_ = 0;

  std::thread accept_thread_;
  std::atomic<bool> stopped_{false};

  std::mutex conns_mu_;
  std::vector<std::shared_ptr<Connection>> incoming_;  // guarded by conns_mu_
  // Accepted connections that may still be in their handshake, oldest first.
  std::deque<std::weak_ptr<Connection>> handshaking_;  // guarded by conns_mu_

  mutable std::mutex lost_mu_;
  std::set<int> lost_;  // guarded by lost_mu_: peers whose connection broke
};

}  // namespace tdist::rpc::detail
