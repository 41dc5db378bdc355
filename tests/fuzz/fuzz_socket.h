#pragma once
// Loopback connections of the fuzz targets that fuzz a running server through its socket
// (store_server, rpc_agent): a connect that retries, and one input sent then drained.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace tdist::fuzz {

// A connection to 127.0.0.1:port. A connect that fails is retried for 10 s before the server
// (named `who` in the messages) counts as dead and the target aborts: a campaign makes about a
// thousand connections a second, and on a loaded machine one connect once failed while the
// server was fine; libFuzzer's timer signal can also interrupt one (EINTR).
inline int connect_loopback(uint16_t port, const char* who) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  auto pause = std::chrono::milliseconds(1);
  for (;;) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) std::abort();
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) return fd;
    const int err = errno;
    ::close(fd);
    if (err == EINTR) continue;
    std::fprintf(stderr, "connect to %s failed (%s); retrying\n", who, std::strerror(err));
    if (std::chrono::steady_clock::now() >= deadline) {
      std::fprintf(stderr, "%s stopped accepting connections: %s\n", who, std::strerror(err));
      std::abort();
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(100));
  }
}

// Sends `size` bytes (until the server closes the connection: a bad frame, fine), half-closes,
// reads the replies until the server closes or 100 ms pass without any, and closes `fd`.
inline void send_and_drain(int fd, const uint8_t* data, size_t size) {
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::send(fd, data + done, size - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  ::shutdown(fd, SHUT_WR);
  uint8_t buf[4096];
  pollfd p{fd, POLLIN, 0};
  for (;;) {
    const int ready = ::poll(&p, 1, 100);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) break;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
  }
  ::close(fd);
}

}  // namespace tdist::fuzz
