// What strangers and token holders can cost a TCPStore server (issue 41, item 3): handshake
// slots a stranger holds, the bytes of request bodies buffered at once, and writes that could
// never be stored. A really started server on 127.0.0.1; raw sockets play the peers, some from
// 127.0.0.2 (another address of loopback) so that the server sees two addresses. And a host that
// vanishes under a store (item 13), in a network namespace of a child process.

#include <arpa/inet.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "tdist/core/detail/tcp_store_protocol.h"
#include "tdist/core/error.h"
#include "tdist/core/net/handshake.h"
#include "tdist/core/net/socket_io.h"
#include "tdist/core/tcp_store.h"
#include "tdist/core/wire.h"
#include "tests/harness/env_guard.h"
#include "tests/harness/expect.h"
#include "tests/harness/memory.h"
#include "tests/harness/process.h"
#include "tests/harness/net.h"

namespace tdist {
namespace {
namespace store_limits {

using namespace std::chrono_literals;
namespace proto = detail::tcp_store;
using test::expect_contains;
using test::expect_throw;

const std::string kToken = "store-limits-token";

bool eventually(const std::function<bool()>& pred, Millis limit = 10s) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return pred();
}

TCPStoreOptions client_options(uint16_t port, Millis timeout) {
  TCPStoreOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.timeout = timeout;
  o.token = kToken;
  return o;
}

// A raw connection to the server at 127.0.0.1:port from `source` (an address of loopback),
// optionally through the connection handshake with the job's token.
class Peer {
 public:
  Peer(uint16_t port, const char* source, bool handshake) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    TDIST_CHECK(fd_ >= 0, std::strerror(errno));
    sockaddr_in from{};
    from.sin_family = AF_INET;
    TDIST_CHECK(::inet_pton(AF_INET, source, &from.sin_addr) == 1, source);
    TDIST_CHECK(::bind(fd_, reinterpret_cast<sockaddr*>(&from), sizeof(from)) == 0,
                std::strerror(errno));
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(port);
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    TDIST_CHECK(::connect(fd_, reinterpret_cast<sockaddr*>(&to), sizeof(to)) == 0,
                std::strerror(errno));
    if (handshake) {
      net::ClientHandshake hs(kToken, net::Service::kStore);
      net::client_handshake(fd_, hs, {}, 0, net::Clock::now() + 10s, "the test's server");
    }
  }
  ~Peer() { ::close(fd_); }
  int fd() const { return fd_; }

  // Sends `n` bytes (from a shared buffer) unless the server stops taking them; returns the
  // bytes sent. `sent` is kept current for other threads.
  size_t stream(size_t n, std::atomic<size_t>& sent) {
    static const std::vector<uint8_t> chunk(1 << 20, 0x5a);
    while (sent < n) {
      const size_t part = std::min(chunk.size(), n - sent);
      const ssize_t k = ::send(fd_, chunk.data(), part, MSG_NOSIGNAL);
      if (k <= 0) break;
      sent += static_cast<size_t>(k);
    }
    return sent;
  }
  void send_all(const Bytes& bytes) {
    net::write_all(fd_, bytes.data(), bytes.size(), net::Clock::now() + 10s, "the test's frame");
  }
  // Wakes a thread blocked in send() on this socket.
  void cut() { ::shutdown(fd_, SHUT_RDWR); }
  // The next reply frame within `limit`; throws TimeoutError when none comes.
  std::pair<proto::Header, Bytes> reply(Millis limit) {
    const auto deadline = net::Clock::now() + limit;
    uint8_t h[proto::kHeaderBytes];
    net::read_exact(fd_, h, sizeof(h), deadline, "a reply header");
    proto::Header header = proto::decode_header(h);
    TDIST_CHECK(header.body_bytes < (1u << 20), "reply body of ", header.body_bytes, " bytes");
    Bytes body(header.body_bytes);
    net::read_exact(fd_, body.data(), body.size(), deadline, "a reply body");
    return {header, body};
  }
  // True when the server closed the connection (EOF or reset) within `limit`.
  bool sees_eof(Millis limit) { return tdist::test::sees_eof(fd_, limit); }

 private:
  int fd_ = -1;
};

// The frame header and body of set(key, value), the value `value_bytes` long; the body's first
// bytes only (the value is streamed separately).
Bytes set_frame_start(const std::string& key, uint64_t value_bytes) {
  Bytes body;
  wire::Writer w(body);
  w.string(key);
  w.u64(value_bytes);  // the blob's length; its bytes follow
  Bytes frame(proto::kHeaderBytes);
  proto::encode_header({proto::kMagic, proto::kVersion, static_cast<uint16_t>(proto::Command::kSet),
                        body.size() + value_bytes},
                       frame.data());
  frame.insert(frame.end(), body.begin(), body.end());
  return frame;
}

std::string reply_message(const Bytes& body) {
  wire::Reader r(body);
  return r.string("message");
}

// A stranger that opens as many connections as the server holds and says nothing must not
// keep a rank out: it gets a few handshake slots per address (4 here), each for a short
// deadline, and a rank's connection displaces a waiting handshake rather than being refused.
// The stranger is tried from another address (127.0.0.2: it holds 4 of the 8 connections) and
// from the rank's own (127.0.0.1: the rank displaces the stranger's oldest handshake).
TEST(TCPStoreLimits, AStrangerHoldingEveryHandshakeSlotDoesNotLockARankOut) {
  test::EnvGuard env(test::EnvVars{{"TDIST_STORE_MAX_CONNECTIONS", "8"},
                                   {"TDIST_STORE_MAX_HANDSHAKES_PER_ADDRESS", "4"},
                                   {"TDIST_STORE_HANDSHAKE_TIMEOUT_MS", "1000"}});
  TCPStoreServer server("127.0.0.1", 0, kToken);
  for (const char* stranger_address : {"127.0.0.2", "127.0.0.1"}) {
    SCOPED_TRACE(stranger_address);
    std::vector<std::unique_ptr<Peer>> stranger;
    for (int i = 0; i < 8; ++i) {
      stranger.push_back(std::make_unique<Peer>(server.port(), stranger_address, false));
    }
    TCPStore rank(client_options(server.port(), 5s));
    rank.set("k", stranger_address);
    EXPECT_EQ(rank.get_string("k"), stranger_address);
    // Every silent connection is closed, the last ones by the handshake deadline.
    for (auto& s : stranger) EXPECT_TRUE(s->sees_eof(10s)) << "a silent stranger kept its slot";
    EXPECT_EQ(rank.get_string("k"), stranger_address) << "an authenticated connection was closed";
  }
}

// A set whose size could never fit in what the store may still hold is refused from its header
// with the limit named, before one byte of its body is read; its body is then skipped without
// being buffered and the connection stays usable.
TEST(TCPStoreLimits, AWriteThatCannotBeStoredIsRefusedFromItsHeader) {
  test::EnvGuard env(test::EnvVars{{"TDIST_STORE_MAX_BYTES", std::to_string(1 << 20)}});
  TCPStoreServer server("127.0.0.1", 0, kToken);
  Peer writer(server.port(), "127.0.0.1", true);
  const uint64_t value_bytes = uint64_t(64) << 20;
  writer.send_all(set_frame_start("big", value_bytes));
  auto [header, body] = writer.reply(10s);  // no body bytes sent yet
  EXPECT_EQ(header.code, static_cast<uint16_t>(proto::Status::kInvalid));
  expect_contains(reply_message(body), "TDIST_STORE_MAX_BYTES");
  std::atomic<size_t> sent{0};
  EXPECT_EQ(writer.stream(value_bytes, sent), value_bytes);
  writer.send_all(proto::make_frame(static_cast<uint16_t>(proto::Command::kNumKeys), {}));
  auto [h2, b2] = writer.reply(10s);
  EXPECT_EQ(h2.code, static_cast<uint16_t>(proto::Status::kOk));
  EXPECT_EQ(server.num_rejected_frames(), 0);
  TCPStore store(client_options(server.port(), 10s));
  expect_contains(
      expect_throw<InvalidArgument>([&] { store.set("big", Bytes(size_t(2) << 20, 1)); }),
      "TDIST_STORE_MAX_BYTES");
  store.set("small", "v");
  EXPECT_EQ(store.get_string("small"), "v");
}

// Eight token holders each start a 12 MiB set and stream 11 MiB of it, then stall: the server
// buffers the bodies of only as many frames as its in-flight budget (16 MiB) takes at once, so
// its memory does not grow by eight bodies. Once they go, a whole 12 MiB set is served.
TEST(TCPStoreLimits, ClientsStreamingBigBodiesAreHeldToTheInFlightBudget) {
  const uint64_t budget = uint64_t(16) << 20;
  test::EnvGuard env(test::EnvVars{{"TDIST_STORE_MAX_INFLIGHT_BYTES", std::to_string(budget)}});
  TCPStoreServer server("127.0.0.1", 0, kToken);
  TCPStore store(client_options(server.port(), 30s));
  store.set("warm", Bytes(size_t(12) << 20, 2));  // the allocator's first big blocks
  ASSERT_TRUE(store.delete_key("warm"));
  const long before = test::peak_rss_kib(true);
  const uint64_t value_bytes = uint64_t(12) << 20;
  const size_t streamed = size_t(11) << 20;
  constexpr int kClients = 8;
  std::vector<std::unique_ptr<Peer>> peers;
  std::vector<std::atomic<size_t>> sent(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    peers.push_back(std::make_unique<Peer>(server.port(), "127.0.0.1", true));
    peers.back()->send_all(set_frame_start("k" + std::to_string(i), value_bytes));
  }
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] { peers[i]->stream(streamed, sent[i]); });
  }
  // Some client is read to its end; then the others get the time to push what they can.
  ASSERT_TRUE(eventually(
      [&] {
        for (auto& s : sent) {
          if (s == streamed) return true;
        }
        return false;
      },
      30s));
  size_t total = 0;
  do {
    total = 0;
    for (auto& s : sent) total += s;
    std::this_thread::sleep_for(300ms);
  } while ([&] {
    size_t now = 0;
    for (auto& s : sent) now += s;
    return now != total;
  }());
  const long after = test::peak_rss_kib(false);
  for (auto& p : peers) p->cut();
  for (auto& t : threads) t.join();
  peers.clear();
  ASSERT_TRUE(eventually([&] { return server.num_connections() == 1; }));
  store.set("whole", Bytes(value_bytes, 3));
  EXPECT_EQ(store.get("whole").size(), value_bytes);
  EXPECT_GT(server.peak_body_bytes(), 0u);
  EXPECT_LE(server.peak_body_bytes(), budget)
      << "more request bodies were taken in than the budget";
  if (before < 0 || after < 0) GTEST_SKIP() << "no /proc/self/status here";
  std::printf("peak RSS grew by %ld KiB; %zu KiB streamed; %llu KiB of bodies taken in at most\n",
              after - before, total / 1024,
              static_cast<unsigned long long>(server.peak_body_bytes() / 1024));
  EXPECT_LT(after - before, 32 * 1024)
      << "peak RSS grew from " << before << " KiB to " << after << " KiB while " << kClients
      << " peers streamed " << total / 1024 << " KiB in all, against a budget of " << budget / 1024
      << " KiB";
}

// ---- a vanished host (Note [Vanished hosts]) ----------------------------------------------------

constexpr int kNoNamespace = 77;

// In a network namespace of its own: a server and a client parked in a get() of 20 s; then the
// namespace's only link goes down (no FIN, no reset reaches either end). Both ends must notice
// by the keepalive of TDIST_TCP_USER_TIMEOUT_MS: the client's get fails with a NetworkError (not
// the TimeoutError of its 20 s), the server drops the connection.
TDIST_TEST_CHILD(store_host_vanishes) {
  if (!test::enter_own_network_namespace()) {
    std::printf("cannot make a network namespace here: %s\n", std::strerror(errno));
    return kNoNamespace;
  }
  TCPStoreServer server("127.0.0.1", 0, kToken);
  TCPStore client(client_options(server.port(), 20s));
  client.set("k", "v");
  std::string outcome = "no error";
  std::thread getter([&] {
    try {
      (void)client.get("never");
    } catch (const NetworkError& e) {
      outcome = std::string("NetworkError: ") + e.what();
    } catch (const Error& e) {
      outcome = std::string("another error: ") + e.what();
    }
  });
  std::this_thread::sleep_for(300ms);  // the get reaches the server (if not, its bytes are unacked)
  if (!test::set_loopback_up(false)) {
    std::printf("cannot take loopback down: %s\n", std::strerror(errno));
    getter.join();
    return 2;
  }
  const auto down = std::chrono::steady_clock::now();
  getter.join();
  const auto client_ms =
      std::chrono::duration_cast<Millis>(std::chrono::steady_clock::now() - down).count();
  const bool dropped = eventually([&] { return server.num_connections() == 0; }, 20s);
  const auto server_ms =
      std::chrono::duration_cast<Millis>(std::chrono::steady_clock::now() - down).count();
  std::printf("client: %s (after %lld ms)\nserver: %s (after %lld ms)\n", outcome.c_str(),
              static_cast<long long>(client_ms),
              dropped ? "dropped the connection" : "still holds the connection",
              static_cast<long long>(server_ms));
  return outcome.rfind("NetworkError", 0) == 0 && dropped ? 0 : 1;
}

TEST(TCPStoreKeepalive, AVanishedHostGivesBothEndsAnErrorWithinTheUserTimeout) {
  test::Processes child("store_host_vanishes", 1, {{"TDIST_TCP_USER_TIMEOUT_MS", "2000"}});
  auto results = child.wait_all(90s);
  if (results[0].exited && results[0].exit_code == kNoNamespace) {
    GTEST_SKIP() << results[0].output;
  }
  EXPECT_TRUE(results[0].ok()) << results[0].describe() << "\n" << results[0].output;
  std::printf("%s", results[0].output.c_str());
}

}  // namespace store_limits
}  // namespace
}  // namespace tdist
