#include "apps/bench/bounds.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "apps/bench/common.h"

namespace tdist::bench {
namespace {

std::runtime_error sys_error(const std::string& what) {
  return std::runtime_error(what + ": " + std::strerror(errno));
}

// What time_tcp() sends before each batch: the transfer size, the pattern and how many.
struct BatchHeader {
  uint64_t bytes;
  uint32_t pattern;
  uint32_t count;
};

}  // namespace

std::vector<double> time_memcpy(size_t bytes, int warmup, int iters) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  return time_calls(warmup, iters, [&](int i) {
    src[0] = static_cast<char>(i);  // a different first byte each call: the copy cannot be elided
    std::memcpy(dst.data(), src.data(), bytes);
    asm volatile("" : : "r"(dst.data()) : "memory");  // the copy is used: it stays
  });
}

TcpLink::~TcpLink() {
  if (fd_ >= 0) ::close(fd_);
}

TcpLink TcpLink::connect(const std::string& host, int port, double timeout_s) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) throw std::runtime_error("cannot resolve " + host + ": " + ::gai_strerror(rc));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
      ::freeaddrinfo(res);
      throw sys_error("socket");
    }
    if (::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
      ::freeaddrinfo(res);
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      return TcpLink(fd);
    }
    const int err = errno;
    ::close(fd);
    if (err != ECONNREFUSED || std::chrono::steady_clock::now() > deadline) {
      ::freeaddrinfo(res);
      errno = err;
      throw sys_error("connect to " + host + ":" + std::to_string(port));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void TcpLink::send_all(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd_, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) throw sys_error("send");
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void TcpLink::recv_all(void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t k = ::recv(fd_, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) throw sys_error("recv");
    if (k == 0) throw std::runtime_error("recv: the peer closed the connection");
    p += k;
    n -= static_cast<size_t>(k);
  }
}

TcpListener::TcpListener(const std::string& host) {
  fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd_ < 0) throw sys_error("socket");
  int one = 1;
  ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    ::close(fd_);
    throw std::runtime_error("not an IPv4 address: " + host);
  }
  socklen_t len = sizeof(addr);
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd_, 4) != 0 ||
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    ::close(fd_);
    errno = err;
    throw sys_error("listen on " + host);
  }
  port_ = ntohs(addr.sin_port);
}

TcpListener::~TcpListener() { ::close(fd_); }

TcpLink TcpListener::accept() {
  for (;;) {
    const int fd = ::accept(fd_, nullptr, nullptr);
    if (fd < 0 && errno == EINTR) continue;
    if (fd < 0) throw sys_error("accept");
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return TcpLink(fd);
  }
}

std::vector<double> time_tcp(TcpLink& link, TcpPattern pattern, size_t bytes, int warmup, int iters) {
  const BatchHeader h{bytes, static_cast<uint32_t>(pattern), static_cast<uint32_t>(warmup + iters)};
  link.send_all(&h, sizeof(h));
  std::vector<char> buf(bytes > 0 ? bytes : 1, 1);
  char ack = 0;
  return time_calls(warmup, iters, [&](int) {
    link.send_all(buf.data(), bytes);
    if (pattern == TcpPattern::kPingPong) {
      link.recv_all(buf.data(), bytes);
    } else {
      link.recv_all(&ack, 1);
    }
  });
}

void serve_tcp_bounds(TcpLink& link) {
  std::vector<char> buf;
  for (;;) {
    BatchHeader h{};
    try {
      link.recv_all(&h, sizeof(h));
    } catch (const std::runtime_error&) {
      return;  // the measuring end closed the link: done
    }
    buf.resize(h.bytes > 0 ? h.bytes : 1);
    const char ack = 1;
    for (uint32_t i = 0; i < h.count; ++i) {
      link.recv_all(buf.data(), h.bytes);
      if (h.pattern == static_cast<uint32_t>(TcpPattern::kPingPong)) {
        link.send_all(buf.data(), h.bytes);
      } else {
        link.send_all(&ack, 1);
      }
    }
  }
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) throw sys_error("gethostname");
  return buf;
}

}  // namespace tdist::bench
