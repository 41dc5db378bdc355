#pragma once
// The bounds that tdist-bench sets its figures against, measured in the same run as the figure:
// one thread's memcpy of a buffer (what moving data through shared memory cannot beat), and a
// plain TCP connection between two endpoints (blocking sockets, TCP_NODELAY, no framing but a
// header per batch): a one-way stream and a ping-pong (what a transport over TCP cannot beat).

#include <cstddef>
#include <string>
#include <vector>

#include "tdist/core/net/address.h"

namespace tdist::bench {

// Seconds per memcpy of `bytes` bytes between two buffers of this thread, `iters` samples after
// `warmup` untimed ones. A sample times enough back-to-back copies to cover 256 KiB (one copy
// from that size up): a lone 4 KiB copy takes tens of nanoseconds, near the clock's own cost
// and resolution, which would understate the bound and round rows of different sizes to the
// same figure.
std::vector<double> time_memcpy(size_t bytes, int warmup, int iters);

// A connected TCP socket with TCP_NODELAY, closed on destruction. Blocking; one thread uses it at
// a time. Failures throw std::runtime_error naming the call.
class TcpLink {
 public:
  explicit TcpLink(int fd) : fd_(fd) {}
  TcpLink(TcpLink&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  TcpLink& operator=(TcpLink&&) = delete;
  ~TcpLink();

  // Connects to host:port, retrying refused connections for up to `timeout_s` seconds.
  static TcpLink connect(const std::string& host, int port, double timeout_s = 30);

  void send_all(const void* data, size_t n);
  void recv_all(void* data, size_t n);

 private:
  int fd_;
};

// A listening TCP socket on `host` (an address or host name; "0.0.0.0": every interface) and a
// port the kernel picks. Closed on destruction.
class TcpListener {
 public:
  explicit TcpListener(const std::string& host);

  int port() const { return listener_.port(); }
  TcpLink accept();

 private:
  net::Listener listener_;
};

enum class TcpPattern {
  kStream,    // `bytes` one way, then a one-byte acknowledgement back
  kPingPong,  // `bytes` one way, the same `bytes` back
};

// Seconds of each of `iters` transfers of `bytes` bytes (after `warmup` untimed ones) between
// this end of `link` and serve_tcp_bounds() at the other.
std::vector<double> time_tcp(TcpLink& link, TcpPattern pattern, size_t bytes, int warmup, int iters);

// The other end of time_tcp(): answers its batches until the link is closed, then returns.
void serve_tcp_bounds(TcpLink& link);

}  // namespace tdist::bench
