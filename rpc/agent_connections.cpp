// RpcAgent, part 2 of 4: connections (agent.h has the whole contract; agent.cpp lists the parts).
// Contract of this part:
// - listen(): one listening socket (core/net/address.h Listener) on RpcOptions::listen_host, else
//   on net::local_address(the store's host), at listen_port (port 0 picks one; host() and port()
//   tell which: that is what the worker publishes). accept_loop() (its own thread)
//   hands every accepted socket to a Connection, which runs the server side of the handshake on
//   its reader thread (rpc/detail/auth.h); finished incoming connections are reaped on the next accept.
//   At most RpcOptions::max_pending_handshakes accepted connections are in their handshake: a
//   new one closes the oldest whose HELLO has not verified (telling it to retry, Note [RPC
//   handshake]), and each handshake has one deadline for all of it.
// - connection_to(rank, deadline): the one outgoing connection to a peer, made on first use
//   (net::connect_once: IPv4, IPv6 or a host name, each address it resolves to in turn).
//   A connect or handshake that fails is retried with backoff (10 ms doubling to 1 s) until the
//   deadline, except a refused handshake (ProtocolError: another token), which fails at once;
//   a busy server (Note [RPC handshake]) is retried. Only the loss of an established
//   connection (one that brought a frame) marks the peer failed: later calls to it fail at once
//   with NetworkError naming the peer and the reason (see RpcAgent::Peer).
// - on_closed() (reader thread): an outgoing connection that closes fails every call pending on
//   it (agent_pending.cpp); incoming ones only log.
#include "tdist/rpc/agent.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <system_error>

#include "tdist/core/logging.h"
#include "tdist/core/token.h"
#include "tdist/rpc/detail/deadline.h"

namespace tdist::rpc {

using detail::remaining;

void RpcAgent::listen() {
  host_ = options_.listen_host.empty() ? net::local_address(store_->server_host())
                                       : options_.listen_host;
  // Note [Secure by default] (core/token.h): decided from the address this worker binds.
  require_token_beyond_loopback(str("the RPC agent of worker '", self_.name, "'"),
                                !options_.token->empty(), host_, "RpcOptions::token");
  const int buffer_bytes = options_.socket_buffer_bytes;
  try {
    // Accepted sockets inherit the listener's buffer sizes.
    listener_ = std::make_unique<net::Listener>(
        host_, options_.listen_port, 512,
        [buffer_bytes](int fd) { detail::set_socket_buffers(fd, buffer_bytes); });
  } catch (const NetworkError& e) {
    throw NetworkError(str("worker '", self_.name, "': ", e.what()));
  }
  port_ = listener_->port();
}

void RpcAgent::accept_loop() {
  for (;;) {
    int fd = -1;
    try {
      fd = listener_->accept(Clock::time_point::max());
    } catch (const NetworkError& e) {
      if (stopped_.load()) return;  // stop_everything() shut the listener down
      TDIST_LOG_WARN("rpc: ", e.what());
      std::this_thread::sleep_for(Millis(10));
      continue;
    }
    auto conn = detail::Connection::incoming(fd, conn_options_, this, pool_.get());
    std::vector<std::shared_ptr<detail::Connection>> done;
    bool refused = false;
    {
      std::lock_guard<std::mutex> lock(conns_mu_);
      if (stopped_.load()) return;  // conn's destructor closes the socket
      auto it = std::partition(incoming_.begin(), incoming_.end(),
                               [](const auto& c) { return !c->finished(); });
      done.assign(std::make_move_iterator(it), std::make_move_iterator(incoming_.end()));
      incoming_.erase(it, incoming_.end());
      incoming_.push_back(conn);
      // Bounded handshakes: the oldest connection whose HELLO has not verified makes room for
      // the newest, so strangers that connect and wait cannot lock a real peer out (its
      // handshake takes milliseconds; theirs end at the handshake deadline anyway). One whose
      // HELLO verified is a peer with the token: it is let finish, and an evicted one is told
      // to retry (Note [RPC handshake], busy).
      handshaking_.erase(std::remove_if(handshaking_.begin(), handshaking_.end(),
                                        [](const auto& w) {
                                          auto c = w.lock();
                                          return !c || c->finished() || c->hello_verified();
                                        }),
                         handshaking_.end());
      while (handshaking_.size() >= static_cast<size_t>(options_.max_pending_handshakes)) {
        auto oldest = handshaking_.front().lock();
        handshaking_.pop_front();
        if (oldest && oldest->evict()) break;
      }
      handshaking_.push_back(conn);
      // Bounded connections: beyond max_connections (what the handshake bound above left) the
      // newest is told busy, before it costs a thread.
      if (incoming_.size() > static_cast<size_t>(options_.max_connections)) {
        incoming_.pop_back();
        handshaking_.pop_back();
        refused = true;
      }
    }
    for (auto& c : done) c->join();
    if (refused) {
      detail::send_busy(fd);
      TDIST_LOG_DEBUG("rpc: refused a connection from ", conn->peer(), ": ",
                      options_.max_connections,
                      " connections are open (RpcOptions::"
                      "max_connections, TDIST_RPC_MAX_CONNECTIONS)");
      continue;  // conn's destructor closes the socket
    }
    try {
      conn->start();
    } catch (const std::system_error& e) {
      // No thread for it (the process is at its thread limit): it goes, the agent stays.
      {
        std::lock_guard<std::mutex> lock(conns_mu_);
        incoming_.erase(std::remove(incoming_.begin(), incoming_.end(), conn), incoming_.end());
      }
      TDIST_LOG_WARN("rpc: closed a new connection from ", conn->peer(),
                     ": cannot start its thread: ", e.what());
    }
  }
}

std::string RpcAgent::on_authenticated(const std::shared_ptr<detail::Connection>& conn) {
  const int rank = conn->peer_rank();
  std::lock_guard<std::mutex> lock(conns_mu_);
  const auto open = std::count_if(incoming_.begin(), incoming_.end(), [rank](const auto& c) {
    return c->peer_rank() == rank && !c->closed() && !c->finished();
  });
  if (open <= options_.max_connections_per_peer) return "";
  return str(peer_name(rank), " already has ", options_.max_connections_per_peer,
             " connections open here (RpcOptions::max_connections_per_peer, "
             "TDIST_RPC_MAX_CONNECTIONS_PER_PEER)");
}

// See RpcAgent::Peer for when a peer counts as failed.
std::shared_ptr<detail::Connection> RpcAgent::connection_to(int rank, Clock::time_point deadline) {
  Peer& p = *peers_.at(rank);
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.conn && !p.conn->closed()) return p.conn;
  if (p.conn && p.failed.empty() && p.conn->received_a_frame()) {
    p.failed = str("connection to ", peer_name(rank), " was lost: ", p.conn->close_reason());
  }
  if (!p.failed.empty()) throw NetworkError(p.failed);
  Millis backoff(10);
  for (int attempt = 1;; ++attempt) {
    if (stopped_.load()) {
      throw Error(str("the RPC agent of worker '", self_.name, "' is shut down"));
    }
    try {
      p.conn = connect(rank, std::min(conn_options_.handshake.timeout, remaining(deadline)));
      return p.conn;
    } catch (const ProtocolError&) {
      throw;  // the peer refused the handshake (another token): retrying cannot help
    } catch (const Error& e) {
      if (Clock::now() + backoff >= deadline) {
        throw NetworkError(str(e.what(), " (", attempt, attempt == 1 ? " attempt" : " attempts",
                               " before the call's deadline)"));
      }
      TDIST_LOG_DEBUG("rpc: connecting to ", peer_name(rank), " failed (attempt ", attempt,
                      "), retrying in ", backoff.count(), " ms: ", e.what());
      // Sleeps in short steps so that a shutdown (which takes p.mu) is not held up.
      const auto wake = Clock::now() + backoff;
      while (Clock::now() < wake && !stopped_.load()) {
        std::this_thread::sleep_for(std::min(Millis(10), remaining(wake)));
      }
      backoff = std::min(backoff * 2, Millis(1000));
    }
  }
}

std::shared_ptr<detail::Connection> RpcAgent::connect(int rank, Millis timeout) {
  const auto& [host, port] = addresses_[rank];
  const int buffer_bytes = conn_options_.socket_buffer_bytes;
  int fd = net::connect_once(
      host, port, timeout.count() > 0 ? Clock::now() + timeout : Clock::time_point::max(),
      peer_name(rank), [buffer_bytes](int s) { detail::set_socket_buffers(s, buffer_bytes); });
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // the connection blocks
  detail::HandshakeOptions handshake = conn_options_.handshake;
  handshake.timeout = timeout;
  detail::HandshakeResult hs;
  try {
    hs = detail::client_handshake(fd, handshake, rank);
  } catch (...) {
    ::close(fd);
    throw;
  }
  auto conn = detail::Connection::outgoing(fd, hs, conn_options_, this, pool_.get());
  try {
    conn->start();
  } catch (const std::system_error& e) {
    throw NetworkError(str("connecting to ", peer_name(rank),
                           ": cannot start the connection's "
                           "thread: ",
                           e.what()));
  }
  TDIST_LOG_DEBUG("rpc: connected to ", peer_name(rank),
                  hs.send_remote_tensors ? " (same-host fast path)" : "");
  return conn;
}

void RpcAgent::on_closed(const std::shared_ptr<detail::Connection>& conn,
                         const std::string& reason) {
  const int rank = conn->peer_rank();
  if (rank < 0) {
    if (!stopped_.load()) {
      // Logged like the store's and the mesh's refusals: the first ten, then every thousandth
      // (counted per process), so a flood of strangers cannot fill the log.
      static std::atomic<int64_t> rejected{0};
      const int64_t n = ++rejected;
      if (n <= 10 || n % 1000 == 0) {
        TDIST_LOG_WARN("rpc: rejected a connection: ", reason, " (", n, " rejected so far)");
      }
    }
    return;
  }
  if (!stopped_.load()) {
    std::lock_guard<std::mutex> lock(lost_mu_);
    lost_.insert(rank);  // see Note [RPC graceful shutdown]
  }
  if (!conn->is_outgoing()) {
    if (!stopped_.load() && !reason.empty()) {
      TDIST_LOG_DEBUG("rpc: connection from ", peer_name(rank), " closed: ", reason);
    }
    return;
  }
  {
    Peer& p = *peers_.at(rank);
    std::lock_guard<std::mutex> lock(p.mu);
    // A connection that closes before its first frame came was never established: the next
    // call connects again.
    if (p.conn == conn && p.failed.empty() && conn->received_a_frame()) {
      p.failed = str("connection to ", peer_name(rank), " was lost: ", reason);
    }
  }
  fail_pending_to(rank, reason);
}

}  // namespace tdist::rpc
