#pragma once
// The client side of TCPStore: a small pool of blocking POSIX sockets to one server, each used by
// one request at a time. See Note [TCPStore protocol] in core/tcp_store.cpp.
//
// Thread safety: request() may be called from many threads at once; each takes its own socket.
// Blocking: every wait (connect, send, receive) uses poll() with the caller's time limit, so a
// dead, stopped or vanished server gives an error, never a hang.

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "tdist/core/detail/tcp_store_protocol.h"
#include "tdist/core/store.h"

namespace tdist::detail {

class TCPStoreClient {
 public:
  struct Reply {
    tcp_store::Status status = tcp_store::Status::kOk;
    Bytes body;
  };

  // Connects one socket and passes the connection handshake with `token` (core/net/handshake.h),
  // retrying until `connect_timeout` passes (the server may start after its clients).
  // NetworkError naming host:port when it cannot connect, ProtocolError at once when the server
  // refuses the handshake (another token).
  TCPStoreClient(std::string host, uint16_t port, Millis connect_timeout, std::string token);
  ~TCPStoreClient();
  TCPStoreClient(const TCPStoreClient&) = delete;
  TCPStoreClient& operator=(const TCPStoreClient&) = delete;

  // Sends one request and waits up to `limit` (zero: forever) for its reply, connecting first when
  // no idle socket is left. `what` names the request in errors ("get('k')"). Throws NetworkError
  // when the connection fails or closes, TimeoutError when `limit` passes, ProtocolError when the
  // reply breaks the protocol; the socket is dropped in each case (its state is unknown).
  Reply request(tcp_store::Command cmd, const Bytes& body, Millis limit, const std::string& what);

  // "host:port", for messages.
  const std::string& address() const { return address_; }

 private:
  using Clock = std::chrono::steady_clock;

  int take_socket(Clock::time_point deadline, Millis limit);
  void give_back(int fd);
  // Connects a new socket and passes the handshake, retrying refused/unreachable attempts until
  // `deadline`.
  int connect(Clock::time_point deadline, Millis limit);

  // Constant after construction.
  const std::string host_;
  const uint16_t port_;
  const std::string address_;
  const Millis connect_timeout_;
  const std::string token_;

  std::mutex mu_;
  std::vector<int> idle_;  // guarded by mu_: connected sockets not in use
};

}  // namespace tdist::detail
