#include "tdist/comm/transport/tcp/listener.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <thread>
#include <vector>

#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"

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

struct Interface {
  std::string name;
  std::string address;  // IPv4, empty when it has none
  bool up = false;
  bool loopback = false;
};

// Every interface of this host (in the kernel's order), with its first IPv4 address.
std::vector<Interface> interfaces() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) {
    TDIST_THROW(NetworkError, "getifaddrs() failed: ", errno_text(errno));
  }
  std::vector<Interface> out;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    auto it = std::find_if(out.begin(), out.end(),
                           [&](const Interface& i) { return i.name == a->ifa_name; });
    if (it == out.end()) {
      out.push_back(Interface{a->ifa_name, "", (a->ifa_flags & IFF_UP) != 0,
                              (a->ifa_flags & IFF_LOOPBACK) != 0});
      it = out.end() - 1;
    }
    if (it->address.empty() && a->ifa_addr != nullptr && a->ifa_addr->sa_family == AF_INET) {
      char text[INET_ADDRSTRLEN] = {0};
      ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text,
                  sizeof(text));
      it->address = text;
    }
  }
  ::freeifaddrs(list);
  return out;
}

// The IPv4 address of the interface `name`, which `var` named.
std::string interface_address(const char* var, const std::string& name) {
  auto all = interfaces();
  std::string known;
  for (const Interface& i : all) known += str(known.empty() ? "" : ", ", i.name);
  auto it = std::find_if(all.begin(), all.end(), [&](const Interface& i) { return i.name == name; });
  TDIST_CHECK_ARG(it != all.end(), var, "='", name, "' names no network interface of this host (",
                  "there are: ", known, ")");
  TDIST_CHECK_ARG(it->up, var, "='", name, "': that interface is down");
  TDIST_CHECK_ARG(!it->address.empty(), var, "='", name, "': that interface has no IPv4 address");
  return it->address;
}

// The local address of the interface that routes to `host`: connect() a UDP socket (no packet
// is sent) and read its local address. Nothing when `host` does not resolve or has no route,
// or when the route is a loopback one (a host name that resolves to this host's own 127.0.1.1).
std::optional<std::string> address_toward(const std::string& host) {
  sockaddr_in remote{};
  try {
    remote = make_address(host, 9);
  } catch (const NetworkError& e) {
    TDIST_LOG_DEBUG("not routing toward the store host: ", e.what());
    return std::nullopt;
  }
  int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::nullopt;
  sockaddr_in local{};
  socklen_t len = sizeof(local);
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&remote), sizeof(remote)) == 0 &&
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
  ::close(fd);
  if (!ok || (ntohl(local.sin_addr.s_addr) >> 24) == 127) return std::nullopt;
  char text[INET_ADDRSTRLEN] = {0};
  ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text));
  return std::string(text);
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

std::string local_address(const std::string& store_host) {
  if (auto host = env::get("TDIST_SOCKET_HOST")) return *host;
  for (const char* var : {"TDIST_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}) {
    if (auto names = env::get(var)) {
      std::string name = names->substr(0, names->find(','));
      std::string address = interface_address(var, name);
      TDIST_LOG_DEBUG("publishing ", address, " (", var, "=", name, ")");
      return address;
    }
  }
  if (!store_host.empty() && !is_loopback(store_host)) {
    if (auto address = address_toward(store_host)) {
      TDIST_LOG_DEBUG("publishing ", *address, " (the interface that routes to the store host ",
                      store_host, ")");
      return *address;
    }
  }
  for (const Interface& i : interfaces()) {
    if (i.up && !i.loopback && !i.address.empty()) {
      TDIST_LOG_DEBUG("publishing ", i.address, " (", i.name,
                      ", the first non-loopback interface that is up)");
      return i.address;
    }
  }
  TDIST_LOG_DEBUG("publishing 127.0.0.1 (no interface but loopback is up)");
  return "127.0.0.1";
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
