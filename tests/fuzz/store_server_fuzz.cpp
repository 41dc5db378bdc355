// Fuzzes the TCPStore server (core/detail/tcp_store_server.cpp) through its socket, as a peer
// would: each input is sent on a fresh connection, which is then half-closed, and its replies
// are read until the server closes it or 100 ms pass. An input whose first byte is even is sent
// after a real connection handshake (it fuzzes the frames); one whose first byte is odd is sent
// from the connection's first byte on (it fuzzes the handshake). One server runs for the whole campaign;
// every 64 inputs a real TCPStore client must still be served (and at the end), so an input that
// wedges or kills the server is a finding, as is any sanitizer report in the server.
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
#include <memory>
#include <thread>

#include "tdist/core/logging.h"
#include "tdist/core/net/handshake.h"
#include "tdist/core/tcp_store.h"
#include "tests/fuzz/fuzz_socket.h"

namespace {

tdist::TCPStoreServer* g_server = nullptr;

void send_input(const uint8_t* data, size_t size) {
  const int fd = tdist::fuzz::connect_loopback(g_server->port(), "the store server");
  if (size > 0 && data[0] % 2 == 0) {
    try {
      tdist::net::ClientHandshake handshake("", tdist::net::Service::kStore);
      tdist::net::client_handshake(fd, handshake, {}, 0,
                                   tdist::net::Clock::now() + std::chrono::seconds(10), "store");
    } catch (const tdist::Error& e) {
      std::fprintf(stderr, "the store server refused an honest handshake: %s\n", e.what());
      std::abort();
    }
    ++data;
    --size;
  }
  tdist::fuzz::send_and_drain(fd, data, size);
}

void expect_served() {
  tdist::TCPStore client("127.0.0.1", g_server->port(), false, std::chrono::seconds(10));
  client.set("fuzz/alive", "1");
  if (client.get_string("fuzz/alive") != "1") std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // The honest handshake must end within this too: 200 ms was once too short for an ASan build on
  // a loaded machine. Inputs never wait for it: each connection is closed after 100 ms of drain.
  ::setenv("TDIST_STORE_FRAME_TIMEOUT_MS", "2000", 1);
  ::setenv("TDIST_STORE_HANDSHAKE_TIMEOUT_MS", "2000", 1);
  ::setenv("TDIST_STORE_MAX_BYTES", "67108864", 1);  // what the inputs store stays bounded
  ::unsetenv("TDIST_TOKEN");
  ::unsetenv("TDIST_TOKEN_FILE");
  tdist::set_log_level(tdist::LogLevel::kOff);
  g_server = new tdist::TCPStoreServer("127.0.0.1", 0);
  std::atexit([] { expect_served(); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static uint64_t runs = 0;
  send_input(data, size);
  if (++runs % 64 == 0) expect_served();
  return 0;
}
