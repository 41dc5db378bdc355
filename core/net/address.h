#pragma once
// The connection layer's addressing, shared by every TCP stack of tdist (the collective mesh in
// comm/transport/tcp, the RPC agent; docs/architecture.md "Connection layer"): host names and
// IPv4/IPv6 literals resolved to socket addresses, the address a process publishes for its
// peers, a listening socket, and connect with retry up to a deadline. Needs no libtorch
// (tdist-run links it). Socket options and framing stay with each stack: Listener and
// connect_to hand back plain descriptors and take a `setup` callback for options that must be
// set before bind/connect (buffer sizes, which accepted sockets inherit from their listener).

#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tdist/core/net/socket_io.h"

namespace tdist::net {

// Called on a fresh socket before it binds (Listener) or connects (connect_to).
using SocketSetup = std::function<void(int fd)>;

// A socket address of either family.
struct Address {
  sockaddr_storage storage{};
  socklen_t len = 0;
  int family() const { return storage.ss_family; }
  sockaddr* get() { return reinterpret_cast<sockaddr*>(&storage); }
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
  uint16_t port() const;
  bool is_loopback() const;
  std::string text() const;  // the address alone ("10.0.0.1", "fd00::1"), no port
};

// host:port as addresses, best first: an IPv4 or IPv6 literal as it is; a host name as
// getaddrinfo's stream addresses of either family (in its order). NetworkError naming the host
// when it does not resolve.
std::vector<Address> resolve(const std::string& host, uint16_t port);

// The address of this host's interface that routes to `host` (loopback for a loopback host):
// the source address the kernel picks, no packet is sent. NetworkError when `host` does not
// resolve or has no route.
std::string source_address_toward(const std::string& host);

// "host:port" for messages and the store, with an IPv6 literal in brackets ("[fd00::1]:29500").
std::string host_port(const std::string& host, uint16_t port);

// True for "localhost" and loopback literals of either family (127.0.0.0/8, ::1).
bool is_loopback_host(const std::string& host);

// A listening TCP socket bound to host:port (the first address `host` resolves to; port 0 picks
// a free one), close-on-exec and non-blocking. Owns the descriptor. Not thread safe, except
// that shutdown() may be called from any thread to wake one blocked in accept().
class Listener {
 public:
  // Throws NetworkError naming host:port when it cannot be bound.
  Listener(const std::string& host, uint16_t port, int backlog, const SocketSetup& setup = {});
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  uint16_t port() const { return port_; }
  const std::string& host() const { return host_; }
  int fd() const { return fd_; }  // to poll for connections beside others

  // The next accepted descriptor (close-on-exec, blocking, no options of its own beyond what it
  // inherits), or -1 when the deadline passes first (time_point::max(): none). NetworkError when
  // accept fails, including after shutdown().
  int accept(Clock::time_point deadline);

  // Wakes a thread blocked in accept() (which then throws) and makes later accepts fail.
  void shutdown();

 private:
  int fd_ = -1;
  std::string host_;
  uint16_t port_ = 0;
};

// The address (IPv4 or IPv6) this process listens on and publishes for its peers
// (docs/architecture.md "Connection layer"), the first that applies of:
//   1. TDIST_SOCKET_HOST (an address or host name, used as given);
//   2. the interface named by TDIST_SOCKET_IFNAME, else GLOO_SOCKET_IFNAME (the first name of a
//      comma-separated list): its IPv4 address, else its global IPv6 one. InvalidArgument naming
//      the variable and the interfaces there are when it is unknown, down or has neither;
//   3. `store_host` (the host of the store the processes meet at; empty when unknown): the
//      address of the interface that routes to it (of its family); loopback for a store at a
//      loopback literal or "localhost": such a job is a job of this host, and nothing it listens
//      on is reachable from the network (issue 41, item 5; up to 5a24577 rule 4 applied and
//      published the LAN address). A name that resolves to loopback (127.0.1.1) is skipped;
//   4. the first non-loopback interface that is up and has an IPv4 address, else a global IPv6
//      one;
//   5. 127.0.0.1 (::1 when loopback has no IPv4 address): this host has no other interface, so
//      every peer is on it.
// A job whose processes meet the store at 127.0.0.1 on one host but at its real address on
// others names its interface (rule 1 or 2) on the store's host.
std::string local_address(const std::string& store_host = {});

// One connect to host:port (each address it resolves to in turn) before the deadline. Returns a
// connected, non-blocking, close-on-exec descriptor; NetworkError "cannot connect to <who> at
// host:port: <last error>" otherwise (a timeout reads "timed out after N ms").
int connect_once(const std::string& host, uint16_t port, Clock::time_point deadline,
                 const std::string& who, const SocketSetup& setup = {});

// connect_once, retried (1 ms doubling to 100 ms apart) until the deadline: the peer may still
// be starting. TimeoutError naming `who`, host:port and the last error otherwise; NetworkError at
// once when `host` does not resolve.
int connect_to(const std::string& host, uint16_t port, Clock::time_point deadline,
               const std::string& who, const SocketSetup& setup = {});

}  // namespace tdist::net
