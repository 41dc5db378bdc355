#include "tdist/rpc/detail/connection_table.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <system_error>

#include "tdist/core/logging.h"
#include "tdist/rpc/detail/auth.h"
#include "tdist/rpc/detail/deadline.h"

namespace tdist::rpc::detail {

ConnectionTable::ConnectionTable(int world_size, const Membership& members,
                                 ConnectionOptions options, ConnectionLimits limits,
                                 ConnectionHandler* handler, Executor* executor)
    : members_(members),
      options_(std::move(options)),
      limits_(limits),
      handler_(handler),
      executor_(executor) {
  for (int i = 0; i < world_size; ++i) peers_.push_back(std::make_unique<Peer>());
}

ConnectionTable::~ConnectionTable() {
  begin_stop();
  close_all("agent destroyed");
  release();
}

void ConnectionTable::listen(const std::string& host, int port) {
  const int buffer_bytes = options_.socket_buffer_bytes;
  try {
    // Accepted sockets inherit the listener's buffer sizes.
    listener_ = std::make_unique<net::Listener>(
        host, port, 512, [buffer_bytes](int fd) { set_socket_buffers(fd, buffer_bytes); });
  } catch (const NetworkError& e) {
    throw NetworkError(str("worker '", members_.self().name, "': ", e.what()));
  }
  port_ = listener_->port();
}

void ConnectionTable::start_accepting() {
  accept_thread_ = std::thread([this] { accept_loop(); });
}

void ConnectionTable::accept_loop() {
  for (;;) {
    int fd = -1;
    try {
      fd = listener_->accept(Clock::time_point::max());
    } catch (const NetworkError& e) {
      if (stopped_.load()) return;  // close_all() shut the listener down
      TDIST_LOG_WARN("rpc: ", e.what());
      std::this_thread::sleep_for(Millis(10));
      continue;
    }
    auto conn = Connection::incoming(fd, options_, handler_, executor_);
    std::vector<std::shared_ptr<Connection>> done;
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
      while (handshaking_.size() >= static_cast<size_t>(limits_.max_pending_handshakes)) {
        auto oldest = handshaking_.front().lock();
        handshaking_.pop_front();
        if (oldest && oldest->evict()) break;
      }
      handshaking_.push_back(conn);
      // Bounded connections: beyond max_connections (what the handshake bound above left) the
      // newest is told busy, before it costs a thread.
      if (incoming_.size() > static_cast<size_t>(limits_.max_connections)) {
        incoming_.pop_back();
        handshaking_.pop_back();
        refused = true;
      }
    }
    for (auto& c : done) c->join();
    if (refused) {
      send_busy(fd);
      TDIST_LOG_DEBUG("rpc: refused a connection from ", conn->peer(), ": ",
                      limits_.max_connections,
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

std::string ConnectionTable::check_authenticated(const std::shared_ptr<Connection>& conn) {
  const int rank = conn->peer_rank();
  std::lock_guard<std::mutex> lock(conns_mu_);
  const auto open = std::count_if(incoming_.begin(), incoming_.end(), [rank](const auto& c) {
    return c->peer_rank() == rank && !c->closed() && !c->finished();
  });
  if (open <= limits_.max_connections_per_peer) return "";
  return str(members_.peer_name(rank), " already has ", limits_.max_connections_per_peer,
             " connections open here (RpcOptions::max_connections_per_peer, "
             "TDIST_RPC_MAX_CONNECTIONS_PER_PEER)");
}

std::shared_ptr<Connection> ConnectionTable::connection_to(int rank, Clock::time_point deadline) {
  Peer& p = *peers_.at(rank);
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.conn && !p.conn->closed()) return p.conn;
  if (p.conn && p.failed.empty() && p.conn->received_a_frame()) {
    p.failed =
        str("connection to ", members_.peer_name(rank), " was lost: ", p.conn->close_reason());
  }
  if (!p.failed.empty()) throw NetworkError(p.failed);
  Millis backoff(10);
  for (int attempt = 1;; ++attempt) {
    if (stopped_.load()) {
      throw Error(str("the RPC agent of worker '", members_.self().name, "' is shut down"));
    }
    try {
      p.conn = connect(rank, std::min(options_.handshake.timeout, remaining(deadline)));
      return p.conn;
    } catch (const ProtocolError&) {
      throw;  // the peer refused the handshake (another token): retrying cannot help
    } catch (const Error& e) {
      // Retries wait for a peer that is not listening yet. One that accepted a connection from
      // here before (p.conn: it closed before its first frame, so the peer is not marked
      // failed) is gone when it cannot be reached again: a worker killed before it answered
      // anything. Retrying would only wait out the call's deadline; the next call tries once
      // more.
      if (p.conn) {
        throw NetworkError(str(e.what(), " (", members_.peer_name(rank),
                               " accepted a connection before: not retried)"));
      }
      if (Clock::now() + backoff >= deadline) {
        throw NetworkError(str(e.what(), " (", attempt, attempt == 1 ? " attempt" : " attempts",
                               " before the call's deadline)"));
      }
      TDIST_LOG_DEBUG("rpc: connecting to ", members_.peer_name(rank), " failed (attempt ", attempt,
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

std::shared_ptr<Connection> ConnectionTable::connect(int rank, Millis timeout) {
  const auto& [host, port] = members_.address(rank);
  const int buffer_bytes = options_.socket_buffer_bytes;
  int fd = net::connect_once(
      host, port, timeout.count() > 0 ? Clock::now() + timeout : Clock::time_point::max(),
      members_.peer_name(rank), [buffer_bytes](int s) { set_socket_buffers(s, buffer_bytes); });
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // the connection blocks
  HandshakeOptions handshake = options_.handshake;
  handshake.timeout = timeout;
  HandshakeResult hs;
  try {
    hs = client_handshake(fd, handshake, rank);
  } catch (...) {
    ::close(fd);
    throw;
  }
  auto conn = Connection::outgoing(fd, hs, options_, handler_, executor_);
  try {
    conn->start();
  } catch (const std::system_error& e) {
    throw NetworkError(str("connecting to ", members_.peer_name(rank),
                           ": cannot start the connection's "
                           "thread: ",
                           e.what()));
  }
  TDIST_LOG_DEBUG("rpc: connected to ", members_.peer_name(rank),
                  hs.send_remote_tensors ? " (same-host fast path)" : "");
  return conn;
}

bool ConnectionTable::on_closed(const std::shared_ptr<Connection>& conn,
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
    return false;
  }
  if (!stopped_.load()) {
    std::lock_guard<std::mutex> lock(lost_mu_);
    lost_.insert(rank);  // see Note [RPC graceful shutdown]
  }
  if (!conn->is_outgoing()) {
    if (!stopped_.load() && !reason.empty()) {
      TDIST_LOG_DEBUG("rpc: connection from ", members_.peer_name(rank), " closed: ", reason);
    }
    return false;
  }
  Peer& p = *peers_.at(rank);
  std::lock_guard<std::mutex> lock(p.mu);
  // A connection that closes before its first frame came was never established: the next
  // call connects again.
  if (p.conn == conn && p.failed.empty() && conn->received_a_frame()) {
    p.failed = str("connection to ", members_.peer_name(rank), " was lost: ", reason);
  }
  return true;
}

std::vector<int> ConnectionTable::lost_peers() const {
  std::lock_guard<std::mutex> lock(lost_mu_);
  return {lost_.begin(), lost_.end()};
}

void ConnectionTable::close_all(const std::string& reason) {
  if (listener_) listener_->shutdown();
  if (accept_thread_.joinable()) accept_thread_.join();
  listener_.reset();
  std::vector<std::shared_ptr<Connection>> conns;
  for (auto& p : peers_) {
    std::lock_guard<std::mutex> lock(p->mu);
    if (p->conn) conns.push_back(p->conn);
    if (p->failed.empty()) {
      p->failed = str("the RPC agent of worker '", members_.self().name, "' ", reason);
    }
  }
  {
    std::lock_guard<std::mutex> lock(conns_mu_);
    for (auto& c : incoming_) conns.push_back(c);
  }
  for (auto& c : conns) c->close(reason);
  for (auto& c : conns) c->join();
}

void ConnectionTable::release() {
  {
    std::lock_guard<std::mutex> lock(conns_mu_);
    incoming_.clear();
  }
  for (auto& p : peers_) {
    std::lock_guard<std::mutex> lock(p->mu);
    p->conn.reset();
  }
}

}  // namespace tdist::rpc::detail
