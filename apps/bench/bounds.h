#pragma once
// The bounds that tdist-bench sets its figures against, measured in the same run as the figure:
// one thread's memcpy of a buffer (what moving data through shared memory cannot beat), and a
// plain TCP connection between two endpoints (blocking sockets, TCP_NODELAY, no framing but a
// header per batch): a one-way stream and a ping-pong (what a transport over TCP cannot beat).

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tdist/core/net/address.h"

namespace tdist::bench {

// Seconds per memcpy of `bytes` bytes between two buffers of this thread, `iters` samples after
// `warmup` untimed ones. A sample times enough back-to-back copies to cover 256 KiB (one copy
// from that size up): a lone 4 KiB copy takes tens of nanoseconds, near the clock's own cost
// and resolution, which would understate the bound and round rows of different sizes to the
// same figure.
std::vector<double> time_memcpy(size_t bytes, int warmup, int iters);

// Note [Cross-core copy]
// What a collective between the processes of one host cannot beat even when it reads its peers'
// buffers where they lie (symmetric memory): the rate at which a core copies a buffer another
// core has just written, whose lines sit modified in the writer's caches, while that core does
// the same with this one's buffer, as the two ranks of a world-2 collective do. busbw counts per
// rank the bytes that an algorithm moving each byte between cores once must take from other
// cores (2(n-1)/n of the buffer for an allreduce, (n-1)/n for an allgather or a reduce-scatter),
// so busbw over this rate is the fraction of that capacity a collective uses. It differs from
// the memcpy bound where one thread's copy stays in its own caches (up to about the L2's size)
// and a cross-core copy cannot. Two threads pinned to the first two CPUs this process may run
// on; each sample, both write their own buffer, meet, copy the other's into a third buffer and
// meet again; one thread's copies are timed (below 64 KiB a sample copies several buffers, as
// time_memcpy does). Seconds per copy, `samples` of them after two untimed; nullopt when fewer
// than two CPUs are allowed or a thread cannot be pinned.
std::optional<std::vector<double>> time_cross_core_copy(size_t bytes, int samples);

// Note [Core-to-core round trip]
// The time for one cache line to go from one core to another and back: two threads, pinned to
// the first two CPUs this process may run on, each storing a counter the other waits for. Every
// hand-off between two ranks of a host (a ring's head, a flag) costs at least half of it. On a
// virtual machine it is not a constant of the hardware: the host may move the virtual CPUs
// between cores that share a cache and cores that do not, and on the 2-core development machine
// it moved between about 120 and 550 ns (50-60 ns at times) from one minute to the next, and
// within runs of 30 seconds; world-2 collectives that move data between the cores ran 2-10x
// slower at 550 ns (docs/perf-history.md, "Issue 18 at its close"). tdist-bench collective
// measures it before and after its rows (rank 0, while the other ranks wait in the store), ddp
// and rpc before and after their runs, so that a run taken in the slow state says so.
struct CoreRoundTrip {
  int cpu_a;
  int cpu_b;
  double ns;  // median of the runs, per round trip
};
// nullopt when fewer than two CPUs are allowed or a thread cannot be pinned.
std::optional<CoreRoundTrip> core_round_trip(int trips = 20000, int runs = 5);

// The round trip before and after a benchmark's figures, as its report prints them.
struct RoundTrips {
  std::optional<CoreRoundTrip> before, after;
  // "core-to-core round trip of a cache line (CPUs A and B): X ns before <what>, Y ns after",
  // with a warning when X and Y differ by more than 1.5x, or that it was not measured.
  std::string describe(const std::string& what) const;
  // {"cpus": [A, B], "before_ns": X, "after_ns": Y}, or null.
  nlohmann::json json() const;
};

// A connected TCP socket with TCP_NODELAY, closed on destruction. Blocking; one thread uses it at
// a time. Failures throw std::runtime_error naming the call.
class TcpLink {
 public:
  explicit TcpLink(int fd) : fd_(fd) {}
  TcpLink(TcpLink&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  TcpLink& operator=(TcpLink&&) = delete;
  ~TcpLink();

  // Connects to host:port, retrying refused connections for up to `timeout_s` seconds, and
  // presents `key` (TcpListener::key of the listener there, passed through the job's store).
  static TcpLink connect(const std::string& host, int port, const std::string& key,
                         double timeout_s = 30);

  void send_all(const void* data, size_t n);
  void recv_all(void* data, size_t n);

 private:
  friend class TcpListener;  // sets its receive timeout while it checks the key
  int fd_;
};

// A listening TCP socket on `host` (an address or host name: the one this rank publishes, not
// every interface) and a port the kernel picks, with a random key of its own. Closed on
// destruction.
class TcpListener {
 public:
  explicit TcpListener(const std::string& host);

  int port() const { return listener_.port(); }
  // What a peer presents first (TcpLink::connect): the measuring rank reads it from the job's
  // store, so a stranger who reaches the port cannot use it.
  const std::string& key() const { return key_; }
  // The first connection that presents the key within a second of connecting; others are
  // closed (with one WARN line each) and the wait goes on.
  TcpLink accept();

 private:
  net::Listener listener_;
  const std::string key_;
};

enum class TcpPattern {
  kStream,    // `bytes` one way, then a one-byte acknowledgement back
  kPingPong,  // `bytes` one way, the same `bytes` back
};

// Seconds of each of `iters` transfers of `bytes` bytes (after `warmup` untimed ones) between
// this end of `link` and serve_tcp_bounds() at the other.
std::vector<double> time_tcp(TcpLink& link, TcpPattern pattern, size_t bytes, int warmup,
                             int iters);

// The other end of time_tcp(): answers its batches until the link is closed, then returns. A
// batch of transfers larger than `max_bytes` (the largest size the benchmark measures) throws
// InvalidArgument before anything is allocated.
void serve_tcp_bounds(TcpLink& link, size_t max_bytes);

}  // namespace tdist::bench
