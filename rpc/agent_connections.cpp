// RpcAgent, part 2 of 4: connections (agent.h has the whole contract; agent.cpp lists the parts).
// Contract of this part:
// - listen(): one listening socket on RpcOptions::listen_host:listen_port (any address family
//   getaddrinfo gives; port 0 picks one, port() tells which). accept_loop() (its own thread)
//   hands every accepted socket to a Connection, which runs the server side of the handshake on
//   its reader thread (rpc/auth.h); finished incoming connections are reaped on the next accept.
//   At most RpcOptions::max_pending_handshakes accepted connections are in their handshake: a
//   new one closes the oldest, and each handshake has one deadline for all of it.
// - connection_to(rank, deadline): the one outgoing connection to a peer, made on first use.
//   A connect or handshake that fails is retried with backoff (10 ms doubling to 1 s) until the
//   deadline, except a refused handshake (ProtocolError: another token), which fails at once.
//   Only the loss of an established connection marks the peer failed: later calls to it fail
//   at once with NetworkError naming the peer and the reason (see RpcAgent::Peer).
// - on_closed() (reader thread): an outgoing connection that closes fails every call pending on
//   it (agent_pending.cpp); incoming ones only log.
#include "tdist/rpc/agent.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "tdist/core/logging.h"
#include "tdist/rpc/detail/deadline.h"

namespace tdist::rpc {

using detail::remaining;

namespace {

struct AddrInfo {
  addrinfo* list = nullptr;
  ~AddrInfo() {
    if (list) ::freeaddrinfo(list);
  }
};

// A connected TCP socket to host:port within `timeout`; NetworkError naming `who` otherwise.
int connect_tcp(const std::string& host, uint16_t port, Millis timeout, const std::string& who,
                int buffer_bytes) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  AddrInfo ai;
  int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &ai.list);
  if (rc != 0) {
    throw NetworkError(str("cannot resolve ", who, " at ", host, ": ", ::gai_strerror(rc)));
  }
  std::string last = "no address";
  for (addrinfo* a = ai.list; a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      last = std::strerror(errno);
      continue;
    }
    detail::set_socket_buffers(fd, buffer_bytes);
    rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      rc = ::poll(&p, 1, static_cast<int>(timeout.count() > 0 ? timeout.count() : -1));
      if (rc == 0) {
        last = str("timed out after ", timeout.count(), " ms");
        ::close(fd);
        continue;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc != 0) {
      last = std::strerror(errno);
      ::close(fd);
      continue;
    }
    int flags = ::fcntl(fd, F_GETFL);
    ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    return fd;
  }
  throw NetworkError(str("cannot connect to ", who, " at ", host, ":", port, ": ", last));
}

}  // namespace

void RpcAgent::listen() {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  AddrInfo ai;
  int rc = ::getaddrinfo(options_.listen_host.c_str(), std::to_string(options_.listen_port).c_str(),
                         &hints, &ai.list);
  TDIST_CHECK_ARG(rc == 0, "cannot resolve listen_host '", options_.listen_host, "': ",
                  ::gai_strerror(rc));
  std::string last = "no address";
  for (addrinfo* a = ai.list; a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    detail::set_socket_buffers(fd, options_.socket_buffer_bytes);  // accepted sockets inherit
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 512) == 0) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
      port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
      listen_fd_ = fd;
      return;
    }
    last = std::strerror(errno);
    ::close(fd);
  }
  throw NetworkError(str("worker '", self_.name, "' cannot listen on ", options_.listen_host, ":",
                         options_.listen_port, ": ", last));
}

void RpcAgent::accept_loop() {
  for (;;) {
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (stopped_.load()) return;
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EINVAL || errno == EBADF) return;  // the listener was shut down
      TDIST_LOG_WARN("rpc: accept failed: ", std::strerror(errno));
      std::this_thread::sleep_for(Millis(10));
      continue;
    }
    auto conn = detail::Connection::incoming(fd, conn_options_, this, pool_.get());
    std::vector<std::shared_ptr<detail::Connection>> done;
    std::shared_ptr<detail::Connection> evicted;
    {
      std::lock_guard<std::mutex> lock(conns_mu_);
      if (stopped_.load()) return;  // conn's destructor closes the socket
      auto it = std::partition(incoming_.begin(), incoming_.end(),
                               [](const auto& c) { return !c->finished(); });
      done.assign(std::make_move_iterator(it), std::make_move_iterator(incoming_.end()));
      incoming_.erase(it, incoming_.end());
      incoming_.push_back(conn);
      // Bounded handshakes: the oldest unauthenticated connection makes room for the newest,
      // so strangers that connect and wait cannot lock a real peer out (its handshake takes
      // milliseconds; theirs end at the handshake deadline anyway).
      handshaking_.erase(std::remove_if(handshaking_.begin(), handshaking_.end(),
                                        [](const auto& w) {
                                          auto c = w.lock();
                                          return !c || c->finished() || c->peer_rank() >= 0;
                                        }),
                         handshaking_.end());
      if (handshaking_.size() >= static_cast<size_t>(options_.max_pending_handshakes)) {
        evicted = handshaking_.front().lock();
        handshaking_.pop_front();
      }
      handshaking_.push_back(conn);
    }
    if (evicted) {
      evicted->close(str(evicted->peer(), ": more than ", options_.max_pending_handshakes,
                         " connections in their handshake (RpcOptions::max_pending_handshakes, "
                         "TDIST_RPC_MAX_PENDING_HANDSHAKES): closed the oldest"));
    }
    for (auto& c : done) c->join();
    conn->start();
  }
}

// See RpcAgent::Peer for when a peer counts as failed.
std::shared_ptr<detail::Connection> RpcAgent::connection_to(int rank, Clock::time_point deadline) {
  Peer& p = *peers_.at(rank);
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.conn && !p.conn->closed()) return p.conn;
  if (p.conn && p.failed.empty()) {
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
  int fd = connect_tcp(host, port, timeout, peer_name(rank), conn_options_.socket_buffer_bytes);
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
  conn->start();
  TDIST_LOG_DEBUG("rpc: connected to ", peer_name(rank), hs.send_remote_tensors
                                                           ? " (same-host fast path)"
                                                           : "");
  return conn;
}

void RpcAgent::on_closed(const std::shared_ptr<detail::Connection>& conn,
                         const std::string& reason) {
  const int rank = conn->peer_rank();
  if (rank < 0) {
    if (!stopped_.load()) TDIST_LOG_WARN("rpc: rejected a connection: ", reason);
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
    if (p.conn == conn && p.failed.empty()) {
      p.failed = str("connection to ", peer_name(rank), " was lost: ", reason);
    }
  }
  fail_pending_to(rank, reason);
}

}  // namespace tdist::rpc
