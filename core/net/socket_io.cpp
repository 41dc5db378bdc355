#include "tdist/core/net/socket_io.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "tdist/core/env.h"
#include "tdist/core/error.h"

namespace tdist::net {
namespace {

// Waits until `fd` is ready for `events`; TimeoutError once the deadline passed.
void wait_ready(int fd, short events, Clock::time_point deadline, const std::string& what) {
  if (poll_one(fd, events, deadline) == 0) throw TimeoutError(what + ": timed out");
}

}  // namespace

int poll_ms(Clock::time_point deadline) {
  if (deadline == kNoDeadline) return -1;
  const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
  if (left.count() <= 0) return 0;
  return static_cast<int>(std::min<int64_t>((left.count() + 999) / 1000, 60000));
}

short poll_one(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, poll_ms(deadline));
    if (rc > 0) return p.revents;
    if (rc == 0) {
      if (Clock::now() >= deadline) return 0;
      continue;
    }
    if (errno != EINTR) TDIST_THROW(NetworkError, "poll failed: ", errno_text(errno));
  }
}

std::string errno_text(int err) { return str("errno ", err, " (", std::strerror(err), ")"); }

void read_exact(int fd, void* data, size_t size, Clock::time_point deadline,
                const std::string& what) {
  auto* p = static_cast<uint8_t*>(data);
  while (size > 0) {
    wait_ready(fd, POLLIN, deadline, what);
    ssize_t n = ::recv(fd, p, size, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
    } else if (n == 0) {
      throw NetworkError(what + ": connection closed by the peer");
    } else if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK) {
      throw NetworkError(what + ": " + std::strerror(errno));
    }
  }
}

void write_all(int fd, const void* data, size_t size, Clock::time_point deadline,
               const std::string& what) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      wait_ready(fd, POLLOUT, deadline, what);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      throw NetworkError(what + ": " + std::strerror(errno));
    }
  }
}

void set_socket_timeouts(int fd, Millis timeout) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

Millis dead_peer_timeout() {
  return Millis(env::get_int("TDIST_TCP_USER_TIMEOUT_MS", 60000, 0, int64_t(1) << 31));
}

void set_dead_peer_timeout(int fd, Millis timeout) {
  // Note [Vanished hosts]. Failures are ignored: a socket that is not TCP (a test's socketpair)
  // keeps working without.
  if (timeout.count() <= 0) return;
  const int64_t ms = std::min<int64_t>(timeout.count(), INT32_MAX);
  const int one = 1;
  const int idle = static_cast<int>(std::clamp<int64_t>(ms / 3000, 1, 32767));
  const int interval = static_cast<int>(std::clamp<int64_t>(ms / 6000, 1, 32767));
  const int probes = 3;  // TCP_USER_TIMEOUT decides when to give up; this is for old kernels
  const unsigned user_timeout = static_cast<unsigned>(ms);
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof(user_timeout));
}

}  // namespace tdist::net
