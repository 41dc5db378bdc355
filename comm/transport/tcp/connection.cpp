#include "tdist/comm/transport/tcp/connection.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "tdist/core/env.h"
#include "tdist/core/error.h"

namespace tdist::comm::tcp {

using net::errno_text;
using net::poll_one;

Connection::Connection(int fd, int peer_rank) : fd_(fd), peer_(peer_rank) {}

Connection::~Connection() { ::close(fd_); }

void Connection::configure(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  // Setting SO_SNDBUF/SO_RCVBUF turns off the kernel's buffer auto-tuning, which on Linux already
  // grows loopback buffers to tcp_wmem/tcp_rmem's maximum; only override when asked.
  static const int64_t buffer = env::get_int("TDIST_SOCKET_BUFFER_BYTES", 0, 0, int64_t(1) << 30);
  if (buffer > 0) {
    int b = static_cast<int>(buffer);
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof(b));
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof(b));
  }
  int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
}

long Connection::writev(const iovec* iov, int count) {
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);
  msg.msg_iovlen = static_cast<size_t>(count);
  for (;;) {
    ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) return n;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    return kError;
  }
}

long Connection::readv(const iovec* iov, int count) {
  for (;;) {
    ssize_t n = ::readv(fd_, iov, count);
    if (n > 0) return n;
    if (n == 0) return kClosed;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    return kError;
  }
}

void Connection::write_all(const void* data, size_t n, Clock::time_point deadline,
                           const char* what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    iovec iov{const_cast<char*>(p), n};
    long k = writev(&iov, 1);
    if (k == kError) {
      TDIST_THROW(NetworkError, "sending ", what, " to rank ", peer_,
                  " failed: ", errno_text(errno));
    }
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (poll_one(fd_, POLLOUT, deadline) == 0) {
      TDIST_THROW(TimeoutError, "timed out sending ", what, " to rank ", peer_);
    }
  }
}

void Connection::read_all(void* data, size_t n, Clock::time_point deadline, const char* what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    iovec iov{p, n};
    long k = readv(&iov, 1);
    if (k == kClosed) {
      TDIST_THROW(NetworkError, "rank ", peer_, " closed the connection while sending ", what);
    }
    if (k == kError) {
      TDIST_THROW(NetworkError, "receiving ", what, " from rank ", peer_,
                  " failed: ", errno_text(errno));
    }
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (poll_one(fd_, POLLIN, deadline) == 0) {
      TDIST_THROW(TimeoutError, "timed out waiting for ", what, " from rank ", peer_);
    }
  }
}

void Connection::shutdown() {
  if (!shut_down_.exchange(true)) ::shutdown(fd_, SHUT_RDWR);
}

}  // namespace tdist::comm::tcp
