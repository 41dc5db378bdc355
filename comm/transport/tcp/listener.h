#pragma once
// Listener: a listening TCP socket bound to host:port (port 0 picks a free one). Used while a
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

  // The next accepted descriptor (configured with Connection::configure), or -1 when the
  // deadline passes first.
  int accept(Clock::time_point deadline);

 private:
  int fd_ = -1;
  std::string host_;
  uint16_t port_ = 0;
};

// The IPv4 address this process publishes for its peers: TDIST_SOCKET_HOST when set; otherwise
// 127.0.0.1 when MASTER_ADDR is unset or a loopback address, else the address of the interface
// that routes to MASTER_ADDR (falling back to what the host name resolves to).
std::string local_address();

// Connects to host:port before the deadline, retrying refused connections (the peer may still
// be starting). Returns a configured descriptor; TimeoutError naming `who` otherwise.
int connect_to(const std::string& host, uint16_t port, Clock::time_point deadline,
               const std::string& who);

}  // namespace tdist::comm::tcp
