#pragma once
// Blocking reads and writes of whole buffers on a socket with one deadline, the way every
// connection of tdist (store, mesh, RPC) does them before it has its own I/O loop: during the
// connection handshake (core/net/handshake.h) and in the store client.
//
// Each call polls before every recv/send and passes MSG_DONTWAIT, so it works on blocking and
// non-blocking descriptors alike and honours the deadline however the peer trickles its bytes.
// Errors: TimeoutError "<what>: timed out" when the deadline passes, NetworkError
// "<what>: connection closed by the peer" on EOF and "<what>: <strerror>" on other failures.
// Thread safety: none beyond the socket's own (one reader and one writer at a time).

#include <chrono>
#include <cstddef>
#include <string>

#include "tdist/core/store.h"

namespace tdist::net {

using Clock = std::chrono::steady_clock;
// No deadline: wait as long as it takes (or the socket's own SO_RCVTIMEO/SO_SNDTIMEO).
constexpr Clock::time_point kNoDeadline = Clock::time_point::max();

void read_exact(int fd, void* data, size_t size, Clock::time_point deadline,
                const std::string& what);
void write_all(int fd, const void* data, size_t size, Clock::time_point deadline,
               const std::string& what);

// SO_RCVTIMEO and SO_SNDTIMEO (0: none), for code that calls recv/send itself.
void set_socket_timeouts(int fd, Millis timeout);

// Note [Vanished hosts]
// ~~~~~~~~~~~~~~~~~~~~~
// A peer whose host loses power, or whose link goes down, sends no FIN and no reset: a socket
// that waits to read from it (a store client parked in get(), a server's idle connection, an RPC
// call without a timeout) would wait for ever, and one with unacknowledged data would retransmit
// for the kernel's ~15 minutes. Every store and RPC socket therefore gets TCP keepalive (first
// probe after a third of `timeout` idle, then every sixth) and TCP_USER_TIMEOUT = `timeout`: the
// kernel fails the connection (ETIMEDOUT) once the peer acknowledged nothing for `timeout`, and
// the reader gets a NetworkError, within about 1.2 x `timeout` of the host's last word. A peer
// that is alive but busy, or stopped (SIGSTOP, a debugger), still answers from its kernel and
// keeps its connections. The collective mesh needs none of this: every collective has a timeout.
//
// The timeout a store or RPC socket uses: TDIST_TCP_USER_TIMEOUT_MS, 60000 by default; 0 turns
// keepalive and the user timeout off (the kernel's defaults).
Millis dead_peer_timeout();
// Turns on keepalive and TCP_USER_TIMEOUT on a TCP socket (nothing for a timeout of 0).
void set_dead_peer_timeout(int fd, Millis timeout);

// Milliseconds for poll() until `deadline`: -1 for kNoDeadline, 0 once it passed, else at
// least 1 (rounded up, so that a poll never returns just before the deadline) and at most one
// minute (callers loop).
int poll_ms(Clock::time_point deadline);

// Waits until `fd` is ready for `events` (POLLIN/POLLOUT) or the deadline passes. Returns the
// revents (0 once the deadline passed). Retries on EINTR; NetworkError when poll fails.
short poll_one(int fd, short events, Clock::time_point deadline);

// "errno 104 (Connection reset by peer)".
std::string errno_text(int err);

}  // namespace tdist::net
