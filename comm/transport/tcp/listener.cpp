#include "tdist/comm/transport/tcp/listener.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <thread>

#include "tdist/core/env.h"
#include "tdist/core/error.h"

namespace tdist::comm::tcp {
namespace {

sockaddr_in make_address(const std::string& host, uint16_t port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) == 1) return addr;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    TDIST_THROW(NetworkError, "cannot resolve host '", host, "': ", ::gai_strerror(rc));
  }
  addr.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  ::freeaddrinfo(res);
  return addr;
}

bool is_loopback(const std::string& host) {
  if (host == "localhost") return true;
  in_addr a{};
  if (::inet_pton(AF_INET, host.c_str(), &a) == 1) return (ntohl(a.s_addr) >> 24) == 127;
  return host == "::1";
}

}  // namespace

Listener::Listener(const std::string& host, uint16_t port, int backlog) : host_(host) {
  sockaddr_in addr = make_address(host, port);
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) TDIST_THROW(NetworkError, "socket() failed: ", errno_text(errno));
  int one = 1;
  ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(fd_, backlog) != 0) {
    int err = errno;
    ::close(fd_);
    TDIST_THROW(NetworkError, "cannot listen on ", host, ":", port, ": ", errno_text(err));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
  ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL, 0) | O_NONBLOCK);
}

Listener::~Listener() {
  if (fd_ >= 0) ::close(fd_);
}

int Listener::accept(Clock::time_point deadline) {
  for (;;) {
    int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      Connection::configure(fd);
      return fd;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      TDIST_THROW(NetworkError, "accept on ", host_, ":", port_, " failed: ", errno_text(errno));
    }
    if (poll_one(fd_, POLLIN, deadline) == 0) return -1;
  }
}

std::string local_address() {
  if (auto host = env::get("TDIST_SOCKET_HOST")) return *host;
  auto master = env::get("MASTER_ADDR");
  if (!master || is_loopback(*master)) return "127.0.0.1";
  // The address of the interface that routes to the master: connect() a UDP socket (no packet
  // is sent) and read its local address. The host name may resolve to a loopback address
  // (Debian's 127.0.1.1), which peers on other hosts cannot reach.
  sockaddr_in master_addr = make_address(*master, 9);
  int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&master_addr), sizeof(master_addr)) == 0 &&
              ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
    ::close(fd);
    if (ok) {
      char text[INET_ADDRSTRLEN] = {0};
      ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text));
      return text;
    }
  }
  char name[256] = {0};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "127.0.0.1";
  sockaddr_in addr = make_address(name, 0);
  char text[INET_ADDRSTRLEN] = {0};
  ::inet_ntop(AF_INET, &addr.sin_addr, text, sizeof(text));
  return text;
}

int connect_to(const std::string& host, uint16_t port, Clock::time_point deadline,
               const std::string& who) {
  sockaddr_in addr = make_address(host, port);
  auto backoff = std::chrono::milliseconds(1);
  int last_error = 0;
  for (;;) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) TDIST_THROW(NetworkError, "socket() failed: ", errno_text(errno));
    int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    if (rc != 0 && errno == EINPROGRESS) {
      short ev = poll_one(fd, POLLOUT, deadline);
      int err = 0;
      socklen_t len = sizeof(err);
      if (ev != 0) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      rc = (ev != 0 && err == 0) ? 0 : -1;
      errno = ev == 0 ? ETIMEDOUT : err;
    }
    if (rc == 0) {
      Connection::configure(fd);
      return fd;
    }
    last_error = errno;
    ::close(fd);
    if (Clock::now() + backoff >= deadline) {
      TDIST_THROW(TimeoutError, "timed out connecting to ", who, " at ", host, ":", port,
                  " (last error: ", errno_text(last_error), ")");
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
  }
}

}  // namespace tdist::comm::tcp
