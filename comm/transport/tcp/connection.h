#pragma once
// Connection: one connected TCP socket to one peer rank (a non-blocking file descriptor with
// TCP_NODELAY and large socket buffers). It owns the descriptor and closes it on destruction.
//
// The connection does no I/O scheduling of its own: the collective engine (engine/exchange.h)
// and the point-to-point engine (engine/p2p_engine.h) drive it with non-blocking
// writev/readv calls from their single thread, so there is no thread hop per message.
//
// Thread safety: I/O from one thread at a time. shutdown() may be called from any thread (it is
// how abort wakes a thread blocked in poll on this socket); the descriptor stays valid until the
// Connection is destroyed.

#include <poll.h>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "tdist/core/net/address.h"

namespace tdist::comm::tcp {

using Clock = net::Clock;

class Connection {
 public:
  Connection(int fd, int peer_rank);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  int fd() const { return fd_; }
  int peer() const { return peer_; }
  // Set once the peer identified itself (mesh handshake), before the connection is shared.
  void set_peer(int peer) { peer_ = peer; }

  // Non-blocking scatter/gather I/O. Return the bytes moved (>= 0; 0 when the socket would
  // block), kClosed when the peer closed the connection (reads only), or kError with errno set.
  static constexpr long kClosed = -1;
  static constexpr long kError = -2;
  long writev(const iovec* iov, int count);
  long readv(const iovec* iov, int count);

  // Blocking helpers with a deadline, used for handshakes: NetworkError when the connection
  // breaks, TimeoutError when the deadline passes (both naming `what` and the peer).
  void write_all(const void* data, size_t n, Clock::time_point deadline, const char* what);
  void read_all(void* data, size_t n, Clock::time_point deadline, const char* what);

  // Makes every blocked and later I/O on this socket fail or see end-of-file (abort). Idempotent.
  void shutdown();
  bool is_shut_down() const { return shut_down_.load(std::memory_order_relaxed); }

  // Applies TCP_NODELAY, keep-alive, and (when TDIST_SOCKET_BUFFER_BYTES > 0) socket buffer sizes;
  // makes the descriptor non-blocking and close-on-exec.
  static void configure(int fd);

 private:
  const int fd_;
  int peer_;
  std::atomic<bool> shut_down_{false};
};

}  // namespace tdist::comm::tcp
