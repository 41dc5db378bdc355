#pragma once
// Channel: a non-blocking byte stream to one peer, as the collective engine (engine/exchange.h)
// drives it. Two implementations: tcp::TcpChannel (the socket itself) and shm::ShmChannel
// (shared-memory rings for peers on the same host, with the TCP connection kept for wake-ups
// and to notice a dead peer).
//
// Thread safety: one thread does I/O; shutdown() may be called from any thread.

#include <poll.h>
#include <sys/uio.h>

#include <chrono>

namespace tdist::comm {

class Channel {
 public:
  static constexpr long kClosed = -1;  // the peer closed the stream (reads)
  static constexpr long kError = -2;   // errno says why

  virtual ~Channel() = default;
  virtual int peer() const = 0;
  virtual const char* kind() const = 0;

  // Move as many bytes as possible without blocking; return them (0: would block).
  virtual long writev(const iovec* iov, int count) = 0;
  virtual long readv(const iovec* iov, int count) = 0;

  // Before sleeping with reads and/or writes pending: fills `pfd` with the descriptor and events
  // to poll, or returns false when progress is already possible (do not sleep).
  virtual bool prepare_wait(bool want_read, bool want_write, pollfd& pfd) = 0;
  // After poll reported `revents` on that descriptor.
  virtual void after_wait(short revents) = 0;

  // Sleeping when this channel is the only one with transfers pending, without a descriptor:
  // returns true once progress may be possible (or the channel failed or was shut down), false
  // when `deadline` passed first. Channels whose wait is their descriptor (TCP) return false
  // from can_wait_alone(); the engine polls them.
  virtual bool can_wait_alone() const { return false; }
  virtual bool wait_alone(bool want_read, bool want_write,
                          std::chrono::steady_clock::time_point deadline) {
    (void)want_read;
    (void)want_write;
    (void)deadline;
    return true;
  }

  virtual void shutdown() = 0;

  // Zero-copy receive (shared memory): the readable bytes as up to two spans, without copying
  // them; returns their total (0: nothing yet; kClosed: closed and drained; kError: errno says
  // why, e.g. EPROTO when the peer broke the ring's protocol). consume(n) releases
  // the first n. Channels without it return false from supports_peek().
  virtual bool supports_peek() const { return false; }
  virtual long peek(iovec spans[2]) {
    (void)spans;
    return 0;
  }
  virtual void consume(size_t n) { (void)n; }
};

}  // namespace tdist::comm
