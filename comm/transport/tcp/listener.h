#pragma once
// Listener: a listening TCP socket bound to host:port (IPv4 or IPv6; port 0 picks a free one). Used while a
// mesh is being built and closed afterwards. Not thread safe; accept() blocks up to a deadline.

#include <cstdint>
#include <string>

#include "tdist/comm/transport/tcp/connection.h"

namespace tdist::comm::tcp {

class Listener {
 public:
  // Throws NetworkError when host:port cannot be bound.
  Listener(const std::string& host, uint16_t port, int backlog);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  uint16_t port() const { return port_; }
  const std::string& host() const { return host_; }
  int fd() const { return fd_; }  // to poll for connections beside others

  // The next accepted descriptor (configured with Connection::configure), or -1 when the
  // deadline passes first.
  int accept(Clock::time_point deadline);

 private:
  int fd_ = -1;
  std::string host_;
  uint16_t port_ = 0;
};

// The address (IPv4 or IPv6) this process listens on and publishes for its peers (docs/comm.md),
// the first that applies of:
//   1. TDIST_SOCKET_HOST (an address or host name, used as given);
//   2. the interface named by TDIST_SOCKET_IFNAME, else GLOO_SOCKET_IFNAME (the first name of a
//      comma-separated list): its IPv4 address, else its global IPv6 one. InvalidArgument naming
//      the variable and the interfaces there are when it is unknown, down or has neither;
//   3. `store_host` (the host of the store the ranks meet at; empty when unknown) when it is not
//      a loopback address: the address of the interface that routes to it (of its family);
//   4. the first non-loopback interface that is up and has an IPv4 address, else a global IPv6
//      one;
//   5. 127.0.0.1 (::1 when loopback has no IPv4 address): this host has no other interface, so
//      every peer is on it.
// Never loopback while another interface is up (unless named): a rank that met the store at
// 127.0.0.1 may still have peers on other hosts that reach the store at its real address.
std::string local_address(const std::string& store_host = {});

// Connects to host:port before the deadline, retrying refused connections (the peer may still
// be starting). Returns a configured descriptor; TimeoutError naming `who` otherwise.
int connect_to(const std::string& host, uint16_t port, Clock::time_point deadline,
               const std::string& who);

}  // namespace tdist::comm::tcp
