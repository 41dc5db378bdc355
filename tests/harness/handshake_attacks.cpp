#include "tests/harness/handshake_attacks.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "tdist/core/error.h"
#include "tdist/core/net/address.h"

namespace tdist::test {
namespace {

net::Clock::time_point soon() { return net::Clock::now() + std::chrono::seconds(10); }

// Reads the challenge of a new connection and returns the HELLO an honest client with `token`
// would send (zero fields).
Bytes hello_for(int fd, const HandshakePort& p, const std::string& token) {
  uint8_t challenge[net::kChallengeBytes];
  net::read_exact(fd, challenge, sizeof(challenge), soon(), "the challenge");
  net::ClientHandshake hs(token, p.service);
  return hs.hello(challenge, sizeof(challenge), Bytes(p.hello_fields, 0));
}

// Sends `hello` and reports whether the server closed instead of accepting.
bool refused(int fd, const Bytes& hello) {
  ::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL);
  const bool closed = closed_within(fd, std::chrono::seconds(10));
  ::close(fd);
  return closed;
}

}  // namespace

int connect_to_port(const HandshakePort& p) {
  const int fd = net::connect_once(p.host, p.port, soon(), "the port under test");
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL, 0) & ~O_NONBLOCK);  // the attacks block on recv
  net::set_socket_timeouts(fd, std::chrono::seconds(10));
  return fd;
}

bool closed_within(int fd, Millis limit) {
  const auto deadline = net::Clock::now() + limit;
  for (;;) {
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, net::poll_ms(deadline)) <= 0) {
      if (net::Clock::now() >= deadline) return false;
      continue;
    }
    uint8_t buf[256];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0 && errno != EAGAIN && errno != EINTR) return errno == ECONNRESET || errno == EPIPE;
  }
}

bool refuses_token(const HandshakePort& p, const std::string& token) {
  const int fd = connect_to_port(p);
  return refused(fd, hello_for(fd, p, token));
}

bool refuses_replayed_hello(const HandshakePort& p, const std::string& token) {
  const int first = connect_to_port(p);
  const Bytes recorded = hello_for(first, p, token);
  ::close(first);
  const int second = connect_to_port(p);
  uint8_t challenge[net::kChallengeBytes];
  net::read_exact(second, challenge, sizeof(challenge), soon(), "the challenge");
  return refused(second, recorded);
}

int stalled_handshake(const HandshakePort& p, const std::string& token) {
  const int fd = connect_to_port(p);
  const Bytes hello = hello_for(fd, p, token);
  net::write_all(fd, hello.data(), hello.size() / 2, soon(), "half a hello");
  return fd;
}

}  // namespace tdist::test
