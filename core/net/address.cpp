#include "tdist/core/net/address.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <optional>
#include <thread>

#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"

namespace tdist::net {
namespace {

// An IPv4 or IPv6 literal as an address (port 0); nothing for anything else.
std::optional<Address> parse_literal(const std::string& host) {
  Address a;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&a.storage);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&a.storage);
  if (::inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    a.len = sizeof(sockaddr_in);
    return a;
  }
  if (::inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    a.len = sizeof(sockaddr_in6);
    return a;
  }
  return std::nullopt;
}

void set_port(Address& a, uint16_t port) {
  if (a.family() == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&a.storage)->sin_port = htons(port);
  } else {
    reinterpret_cast<sockaddr_in6*>(&a.storage)->sin6_port = htons(port);
  }
}

// resolve() without exceptions: false with `error` set when `host` does not resolve.
bool resolve_into(const std::string& host, uint16_t port, std::vector<Address>& out,
                  std::string& error) {
  out.clear();
  if (auto literal = parse_literal(host)) {
    out.push_back(*literal);
  } else {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
    if (rc != 0) {
      error = str("cannot resolve host '", host, "': ", ::gai_strerror(rc));
      return false;
    }
    for (addrinfo* r = res; r != nullptr; r = r->ai_next) {
      if (r->ai_family != AF_INET && r->ai_family != AF_INET6) continue;
      Address a;
      std::memcpy(&a.storage, r->ai_addr, r->ai_addrlen);
      a.len = static_cast<socklen_t>(r->ai_addrlen);
      out.push_back(a);
    }
    ::freeaddrinfo(res);
    if (out.empty()) {
      error = str("cannot resolve host '", host, "': it has no IP address");
      return false;
    }
  }
  for (Address& a : out) set_port(a, port);
  return true;
}

// One connect to each of `addresses` in turn before the deadline: the connected descriptor, or
// -1 with `error` set to the last failure.
int try_connect(const std::vector<Address>& addresses, Clock::time_point deadline,
                const SocketSetup& setup, std::string& error) {
  const auto start = Clock::now();
  for (const Address& addr : addresses) {
    int fd = ::socket(addr.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      error = errno_text(errno);
      continue;
    }
    if (setup) setup(fd);
    int rc = ::connect(fd, addr.get(), addr.len);
    if (rc != 0 && errno == EINPROGRESS) {
      short ev = poll_one(fd, POLLOUT, deadline);
      if (ev == 0) {
        ::close(fd);
        error =
            str("timed out after ",
                std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count(),
                " ms");
        return -1;  // the deadline is spent for every address
      }
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc == 0) return fd;
    error = errno_text(errno);
    ::close(fd);
  }
  return -1;
}

struct Interface {
  std::string name;
  std::string address;   // IPv4, empty when it has none
  std::string address6;  // IPv6 of global (or loopback) scope, empty when it has none
  bool up = false;
  bool loopback = false;
};

// Every interface of this host (in the kernel's order), with its first IPv4 address and its
// first IPv6 address that needs no scope (not link-local).
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
      out.push_back(Interface{a->ifa_name, "", "", (a->ifa_flags & IFF_UP) != 0,
                              (a->ifa_flags & IFF_LOOPBACK) != 0});
      it = out.end() - 1;
    }
    if (a->ifa_addr == nullptr) continue;
    Address addr;
    if (a->ifa_addr->sa_family == AF_INET) {
      std::memcpy(&addr.storage, a->ifa_addr, sizeof(sockaddr_in));
      if (it->address.empty()) it->address = addr.text();
    } else if (a->ifa_addr->sa_family == AF_INET6) {
      std::memcpy(&addr.storage, a->ifa_addr, sizeof(sockaddr_in6));
      const auto* v6 = reinterpret_cast<const sockaddr_in6*>(a->ifa_addr);
      if (it->address6.empty() && !IN6_IS_ADDR_LINKLOCAL(&v6->sin6_addr))
        it->address6 = addr.text();
    }
  }
  ::freeifaddrs(list);
  return out;
}

// The address (IPv4, else IPv6) of the interface `name`, which `var` named.
std::string interface_address(const char* var, const std::string& name) {
  auto all = interfaces();
  std::string known;
  for (const Interface& i : all) known += str(known.empty() ? "" : ", ", i.name);
  auto it =
      std::find_if(all.begin(), all.end(), [&](const Interface& i) { return i.name == name; });
  TDIST_CHECK_ARG(it != all.end(), var, "='", name, "' names no network interface of this host (",
                  "there are: ", known, ")");
  TDIST_CHECK_ARG(it->up, var, "='", name, "': that interface is down");
  TDIST_CHECK_ARG(!it->address.empty() || !it->address6.empty(), var, "='", name,
                  "': that interface has no IPv4 or global IPv6 address");
  return !it->address.empty() ? it->address : it->address6;
}

// source_address_toward, or nothing when `host` does not resolve or has no route, or when the
// route is a loopback one (a host name that resolves to this host's own 127.0.1.1).
std::optional<std::string> address_toward(const std::string& host) {
  try {
    std::string local = source_address_toward(host);
    if (!is_loopback_host(local)) return local;
  } catch (const NetworkError& e) {
    TDIST_LOG_DEBUG("not routing toward the store host: ", e.what());
  }
  return std::nullopt;
}

}  // namespace

uint16_t Address::port() const {
  return ntohs(family() == AF_INET ? reinterpret_cast<const sockaddr_in*>(&storage)->sin_port
                                   : reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_port);
}

bool Address::is_loopback() const {
  if (family() == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr.s_addr) >> 24) == 127;
  }
  return IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr);
}

std::string Address::text() const {
  char text[INET6_ADDRSTRLEN] = {0};
  const void* bytes =
      family() == AF_INET
          ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr)
          : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr);
  ::inet_ntop(family(), bytes, text, sizeof(text));
  return text;
}

std::vector<Address> resolve(const std::string& host, uint16_t port) {
  std::vector<Address> out;
  std::string error;
  if (!resolve_into(host, port, out, error)) TDIST_THROW(NetworkError, error);
  return out;
}

std::string source_address_toward(const std::string& host) {
  // connect() on a datagram socket only picks the route and the source address: no packet.
  const Address remote = resolve(host, 9).front();
  int fd = ::socket(remote.family(), SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) TDIST_THROW(NetworkError, "socket() failed: ", errno_text(errno));
  Address local;
  local.len = sizeof(local.storage);
  const bool ok = ::connect(fd, remote.get(), remote.len) == 0 &&
                  ::getsockname(fd, local.get(), &local.len) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) TDIST_THROW(NetworkError, "no route to '", host, "': ", errno_text(err));
  return local.text();
}

std::string host_port(const std::string& host, uint16_t port) {
  return host.find(':') != std::string::npos ? str("[", host, "]:", port) : str(host, ":", port);
}

bool is_loopback_host(const std::string& host) {
  if (host == "localhost") return true;
  auto literal = parse_literal(host);
  return literal && literal->is_loopback();
}

Listener::Listener(const std::string& host, uint16_t port, int backlog, const SocketSetup& setup)
    : host_(host) {
  Address addr = resolve(host, port).front();
  fd_ = ::socket(addr.family(), SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) TDIST_THROW(NetworkError, "socket() failed: ", errno_text(errno));
  int one = 1;
  ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (setup) setup(fd_);
  if (::bind(fd_, addr.get(), addr.len) != 0 || ::listen(fd_, backlog) != 0) {
    int err = errno;
    ::close(fd_);
    TDIST_THROW(NetworkError, "cannot listen on ", host_port(host, port), ": ", errno_text(err));
  }
  addr.len = sizeof(addr.storage);
  ::getsockname(fd_, addr.get(), &addr.len);
  port_ = addr.port();
  ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL, 0) | O_NONBLOCK);
}

Listener::~Listener() {
  if (fd_ >= 0) ::close(fd_);
}

void Listener::shutdown() { ::shutdown(fd_, SHUT_RDWR); }

// Out of descriptors (EMFILE: this process, ENFILE: the system), the connection stays queued:
// it is accepted once one is free, so accept backs off (1 ms doubling to 100 ms) and retries
// until its deadline rather than failing (issue 41, item 4). Logged like the store's refusals.
int Listener::accept(Clock::time_point deadline) {
  static std::atomic<int64_t> short_of_descriptors{0};
  auto backoff = std::chrono::milliseconds(1);
  for (;;) {
    int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) return fd;
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EMFILE || errno == ENFILE) {
      const int64_t n = short_of_descriptors.fetch_add(1) + 1;
      if (n == 1 || n % 1000 == 0) {
        TDIST_LOG_WARN("accept on ", host_port(host_, port_), ": ", errno_text(errno),
                       "; the connection waits until a descriptor is free (", n, " times so far)");
      }
      const auto now = Clock::now();
      if (now >= deadline) return -1;
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
      continue;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      TDIST_THROW(NetworkError, "accept on ", host_port(host_, port_),
                  " failed: ", errno_text(errno));
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
  if (is_loopback_host(store_host)) {
    // A store on loopback (a literal, or "localhost") means a job of this host: its ranks
    // publish (and bind) loopback too. A host name that merely resolves to 127.0.1.1 is not
    // taken as one: other hosts may know it by its real address.
    try {
      const std::string address = source_address_toward(store_host);
      TDIST_LOG_DEBUG("publishing ", address, " (the store host ", store_host, " is loopback)");
      return address;
    } catch (const NetworkError& e) {
      TDIST_LOG_DEBUG("no route toward the store host on loopback: ", e.what());
    }
  }
  if (!store_host.empty() && !is_loopback_host(store_host)) {
    if (auto address = address_toward(store_host)) {
      TDIST_LOG_DEBUG("publishing ", *address, " (the interface that routes to the store host ",
                      store_host, ")");
      return *address;
    }
  }
  const auto all = interfaces();
  for (bool v6 : {false, true}) {
    for (const Interface& i : all) {
      const std::string& address = v6 ? i.address6 : i.address;
      if (i.up && !i.loopback && !address.empty()) {
        TDIST_LOG_DEBUG("publishing ", address, " (", i.name,
                        ", the first non-loopback interface that is up)");
        return address;
      }
    }
  }
  // Only loopback: 127.0.0.1, or ::1 on a host whose loopback has no IPv4 address.
  for (const Interface& i : all) {
    if (i.loopback && i.up && i.address.empty() && !i.address6.empty()) {
      TDIST_LOG_DEBUG("publishing ", i.address6, " (only loopback is up, and it has no IPv4)");
      return i.address6;
    }
  }
  TDIST_LOG_DEBUG("publishing 127.0.0.1 (no interface but loopback is up)");
  return "127.0.0.1";
}

int connect_once(const std::string& host, uint16_t port, Clock::time_point deadline,
                 const std::string& who, const SocketSetup& setup) {
  std::vector<Address> addresses;
  std::string error;
  int fd = resolve_into(host, port, addresses, error)
               ? try_connect(addresses, deadline, setup, error)
               : -1;
  if (fd < 0)
    TDIST_THROW(NetworkError, "cannot connect to ", who, " at ", host_port(host, port), ": ",
                error);
  return fd;
}

int connect_to(const std::string& host, uint16_t port, Clock::time_point deadline,
               const std::string& who, const SocketSetup& setup) {
  const std::vector<Address> addresses = resolve(host, port);
  auto backoff = std::chrono::milliseconds(1);
  for (;;) {
    std::string error;
    int fd = try_connect(addresses, deadline, setup, error);
    if (fd >= 0) return fd;
    if (Clock::now() + backoff >= deadline) {
      TDIST_THROW(TimeoutError, "timed out connecting to ", who, " at ", host_port(host, port),
                  " (last error: ", error, ")");
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
  }
}

}  // namespace tdist::net
