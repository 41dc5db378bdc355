// TCPStore against a really started server on 127.0.0.1: concurrency, disconnects, a server
// that goes away or stops answering, malformed frames from raw sockets, num_workers, and real
// child processes.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "tdist/core/detail/tcp_store_protocol.h"
#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/net/handshake.h"
#include "tdist/core/tcp_store.h"
#include "tdist/core/wire.h"
#include "tests/core/store_worker.h"
#include "tests/harness/env_guard.h"
#include "tests/harness/expect.h"
#include "tests/harness/memory.h"
#include "tests/harness/net.h"
#include "tests/harness/process.h"

namespace tdist {
namespace {

using test::expect_contains;
using test::expect_throw;
using test::free_port;
using test::peak_rss_kib;

using namespace std::chrono_literals;
namespace proto = detail::tcp_store;

using test::kTimeout;

// Polls `pred` until it holds or `limit` passes; the final value of pred.
bool eventually(const std::function<bool()>& pred, Millis limit = 10s) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return pred();
}

// ---- raw sockets ----------------------------------------------------------------------------

sockaddr_in loopback(uint16_t port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return addr;
}

// A peer that writes frames by hand, after passing the connection handshake (with no token)
// unless told not to.
class RawSocket {
 public:
  explicit RawSocket(uint16_t port, bool handshake = true) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    TDIST_CHECK(fd_ >= 0, std::strerror(errno));
    sockaddr_in addr = loopback(port);
    TDIST_CHECK(::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0,
                std::strerror(errno));
    if (handshake) {
      net::ClientHandshake hs("", net::Service::kStore);
      net::client_handshake(fd_, hs, {}, 0, net::Clock::now() + kTimeout, "the test's server");
    }
  }
  ~RawSocket() {
    if (fd_ >= 0) ::close(fd_);
  }
  void send(const Bytes& bytes) {
    TDIST_CHECK_EQ(::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL),
                   static_cast<ssize_t>(bytes.size()));
  }
  void shutdown_write() { ::shutdown(fd_, SHUT_WR); }
  // Closes with a TCP reset (no orderly FIN), as a crashed peer might.
  void reset() {
    linger l{1, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
    ::close(fd_);
    fd_ = -1;
  }
  // True when the server closed the connection (EOF or reset) within `limit`.
  bool sees_eof(Millis limit = 10s) { return tdist::test::sees_eof(fd_, limit); }

 private:
  int fd_ = -1;
};

// The server side of the connection handshake (no token) on an accepted socket of a fake
// server; false when the client did not pass it.
bool serve_handshake(int fd) {
  try {
    net::ServerHandshake hs("", net::Service::kStore);
    const auto deadline = net::Clock::now() + kTimeout;
    net::write_all(fd, hs.challenge().data(), hs.challenge().size(), deadline, "challenge");
    Bytes hello(net::hello_bytes(0));
    net::read_exact(fd, hello.data(), hello.size(), deadline, "hello");
    hs.verify_hello(hello.data(), hello.size(), 0);
    const Bytes accept = hs.accept({});
    net::write_all(fd, accept.data(), accept.size(), deadline, "accept");
    return true;
  } catch (const Error&) {
    return false;
  }
}

// A socket listening on a free loopback port (set in `port`); -1 when that fails.
int listening_socket(uint16_t& port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = loopback(0);
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(fd, 16) != 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  port = ntohs(addr.sin_port);
  return fd;
}

Bytes header(uint32_t magic, uint16_t version, uint16_t code, uint64_t body_bytes) {
  Bytes out(proto::kHeaderBytes);
  proto::encode_header({magic, version, code, body_bytes}, out.data());
  return out;
}

Bytes wait_frame(const std::string& key, Millis timeout) {
  Bytes body;
  wire::Writer w(body);
  proto::write_keys(w, {key});
  w.i64(timeout.count());
  return proto::make_frame(static_cast<uint16_t>(proto::Command::kWait), body);
}

// ---- tests ----------------------------------------------------------------------------------

TEST(TCPStore, ServerOnPortZeroReportsTheBoundPort) {
  TCPStore server("127.0.0.1", 0, /*is_server=*/true, kTimeout);
  ASSERT_NE(server.port(), 0);
  ASSERT_NE(server.server(), nullptr);
  EXPECT_EQ(server.server()->port(), server.port());
  TCPStore client("127.0.0.1", server.port(), false, kTimeout);
  client.set("k", "v");
  EXPECT_EQ(server.get_string("k"), "v");
  EXPECT_EQ(client.server(), nullptr);
}

TEST(TCPStore, ClientWithoutAPortIsInvalid) {
  expect_throw<InvalidArgument>([] { TCPStore("127.0.0.1", 0, false, kTimeout); });
}

TEST(TCPStore, BindingAPortInUseNamesThePort) {
  TCPStoreServer first("127.0.0.1", 0);
  std::string msg =
      expect_throw<NetworkError>([&] { TCPStoreServer second("127.0.0.1", first.port()); });
  expect_contains(msg, std::to_string(first.port()));
}

TEST(TCPStore, SixteenThreadsMixedOpsAllLand) {
  TCPStore server("127.0.0.1", 0, true, kTimeout);
  // Half the threads share one TCPStore (its connection pool), half open their own.
  auto shared = std::make_shared<TCPStore>("127.0.0.1", server.port(), false, kTimeout);
  constexpr int kThreads = 16;
  constexpr int kOps = 1000;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        std::shared_ptr<TCPStore> store =
            t % 2 == 0 ? shared
                       : std::make_shared<TCPStore>("127.0.0.1", server.port(), false, kTimeout);
        const std::string me = "t" + std::to_string(t);
        std::string last_cs;
        for (int i = 0; i < kOps; ++i) {
          switch (i % 5) {
            case 0:
              store->add("counter", 1);
              break;
            case 1:
              store->set(me + "/k" + std::to_string(i), std::to_string(i));
              break;
            case 2:
              if (store->get_string(me + "/k" + std::to_string(i - 1)) != std::to_string(i - 1))
                failures++;
              break;
            case 3: {
              std::string next = std::to_string(i);
              Bytes got = store->compare_set(me + "/cs", to_bytes(last_cs), to_bytes(next));
              if (to_string(got) != next) failures++;
              last_cs = next;
              break;
            }
            case 4:
              if (!store->check({me + "/cs", "counter"})) failures++;
              break;
          }
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << "thread " << t << ": " << e.what();
        failures++;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(server.get_string("counter"), std::to_string(kThreads * kOps / 5));
  // counter + per thread: kOps/5 "k" keys and one "cs" key.
  EXPECT_EQ(server.num_keys(), 1 + kThreads * (kOps / 5 + 1));
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(server.get_string("t" + std::to_string(t) + "/cs"), std::to_string(kOps - 2));
  }
}

TEST(TCPStore, TimedOutGetLeavesTheStoreUsable) {
  TCPStoreServer server("127.0.0.1", 0);
  TCPStore client("127.0.0.1", server.port(), false, 300ms);
  expect_throw<TimeoutError>([&] { client.get("absent"); });
  client.set("absent", "now");
  EXPECT_EQ(client.get_string("absent"), "now");
  expect_throw<TimeoutError>([&] { client.wait({"other"}, 300ms); });
  EXPECT_EQ(client.add("n", 2), 2);
}

TEST(TCPStore, ABlockedGetDoesNotHoldUpOtherThreadsOfTheSameStore) {
  TCPStore server("127.0.0.1", 0, true, kTimeout);
  TCPStore client("127.0.0.1", server.port(), false, kTimeout);
  std::thread setter([&] {
    std::this_thread::sleep_for(50ms);
    client.set("late", "v");  // same object as the blocked get below
  });
  EXPECT_EQ(client.get_string("late"), "v");
  setter.join();
}

TEST(TCPStore, ClientsThatDisconnectDoNotStopTheServer) {
  TCPStoreServer server("127.0.0.1", 0);
  TCPStore keeper("127.0.0.1", server.port(), false, kTimeout);
  keeper.set("a", "1");
  {
    TCPStore brief("127.0.0.1", server.port(), false, kTimeout);
    brief.set("b", "2");
  }
  {
    RawSocket parked(server.port());  // parked in a wait, then reset mid-wait
    parked.send(wait_frame("never", Millis(0)));
    RawSocket parked_fin(server.port());  // parked in a wait, then closed politely
    parked_fin.send(wait_frame("never", Millis(0)));
    ASSERT_TRUE(eventually([&] { return server.num_connections() == 3; }));
    parked.reset();
  }
  ASSERT_TRUE(eventually([&] { return server.num_connections() == 1; }))
      << server.num_connections();
  // The dropped waiters are gone: completing their key touches nothing stale.
  keeper.set("never", "x");
  EXPECT_EQ(keeper.get_string("b"), "2");
  EXPECT_EQ(keeper.num_keys(), 3);
  EXPECT_EQ(server.num_rejected_frames(), 0);
}

TEST(TCPStore, ServerThatGoesAwayGivesBlockedClientsAnError) {
  auto server = std::make_unique<TCPStoreServer>("127.0.0.1", 0);
  const uint16_t port = server->port();
  TCPStore client("127.0.0.1", port, false, 2s);
  std::string error;
  std::thread blocked([&] { error = expect_throw<NetworkError>([&] { client.get("never"); }); });
  std::this_thread::sleep_for(100ms);  // let the get reach the server (either way it must fail)
  server.reset();                      // must not hang with a parked client
  blocked.join();
  expect_contains(error, "127.0.0.1:" + std::to_string(port));
  // Later requests fail too, within the store's timeout.
  std::string later = expect_throw<NetworkError>([&] { client.set("k", "v"); });
  expect_contains(later, "127.0.0.1:" + std::to_string(port));
}

TEST(TCPStore, UnresponsiveServerGivesTimeoutError) {
  // A socket that listens but never accepts or answers: connect completes from the backlog,
  // and the handshake never starts.
  uint16_t port = 0;
  const int fd = listening_socket(port);
  ASSERT_GE(fd, 0);
  std::string msg =
      expect_throw<TimeoutError>([&] { TCPStore client("127.0.0.1", port, false, 500ms); });
  expect_contains(msg, "127.0.0.1:" + std::to_string(port));
  expect_contains(msg, "no handshake within 0.5 s");
  ::close(fd);
}

TEST(TCPStore, ServerThatStopsAnsweringAfterTheHandshakeGivesTimeoutError) {
  uint16_t port = 0;
  const int listener = listening_socket(port);
  ASSERT_GE(listener, 0);
  std::atomic<bool> done{false};
  std::thread server([&] {
    int fd = ::accept(listener, nullptr, nullptr);
    if (fd < 0) return;
    serve_handshake(fd);
    while (!done) std::this_thread::sleep_for(10ms);
    ::close(fd);
  });
  {
    TCPStore client("127.0.0.1", port, false, 500ms);
    std::string msg = expect_throw<TimeoutError>([&] { client.set("k", "v"); });
    expect_contains(msg, "127.0.0.1:" + std::to_string(port));
    expect_contains(msg, "set('k')");
  }
  done = true;
  server.join();
  ::close(listener);
}

TEST(TCPStore, ReplyHeaderThatOverstatesItsBodyCostsOnlyWhatArrives) {
  // A "server" that answers any request with a header declaring an almost 1 GiB body (the frame
  // limit), sends 4 KiB of it and then nothing: the client times out, and its memory grows by
  // about what arrived, not by the claim.
  uint16_t port = 0;
  const int listener = listening_socket(port);
  ASSERT_GE(listener, 0);
  std::atomic<bool> done{false};
  std::thread server([&] {
    int fd = ::accept(listener, nullptr, nullptr);
    if (fd < 0) return;
    serve_handshake(fd);
    proto::Header h;
    h.code = static_cast<uint16_t>(proto::Status::kOk);
    h.body_bytes = TCPStoreServer::kMaxFrameBytes - 1;
    uint8_t header[proto::kHeaderBytes];
    proto::encode_header(h, header);
    std::vector<uint8_t> first(4096, 7);
    char request[256];
    (void)::recv(fd, request, sizeof(request), 0);
    (void)::send(fd, header, sizeof(header), MSG_NOSIGNAL);
    (void)::send(fd, first.data(), first.size(), MSG_NOSIGNAL);
    while (!done) std::this_thread::sleep_for(10ms);
    ::close(fd);
  });
  const long before = peak_rss_kib(true);
  {
    TCPStore client("127.0.0.1", port, false, 1s);
    std::string msg = expect_throw<TimeoutError>([&] { (void)client.get("k"); });
    expect_contains(msg, "127.0.0.1:" + std::to_string(port));
  }
  const long after = peak_rss_kib(false);
  done = true;
  server.join();
  ::close(listener);
  if (before < 0 || after < 0) GTEST_SKIP() << "no /proc/self/status here";
  EXPECT_LT(after - before, 64 * 1024) << "peak RSS grew from " << before << " KiB to " << after
                                       << " KiB for a reply that sent 4 KiB";
}

Bytes get_frame(const std::string& key) {
  Bytes body;
  wire::Writer w(body);
  w.string(key);
  w.i64(1000);
  return proto::make_frame(static_cast<uint16_t>(proto::Command::kGet), body);
}

TEST(TCPStore, PipelinedGetsThatAreNotReadCostTheServerOneReply) {
  // 64 gets of a 4 MiB value sent back to back by a peer that never reads: the server reads
  // the next request only after writing the previous reply, so it holds one reply (plus what
  // the socket buffers take), not 64 copies of the value.
  TCPStoreServer server("127.0.0.1", 0);
  TCPStore store("127.0.0.1", server.port(), false, kTimeout);
  store.set("big", Bytes(size_t(4) << 20, 1));
  const long before = peak_rss_kib(true);
  RawSocket greedy(server.port());
  Bytes frames;
  for (int i = 0; i < 64; ++i) {
    Bytes f = get_frame("big");
    frames.insert(frames.end(), f.begin(), f.end());
  }
  greedy.send(frames);
  std::this_thread::sleep_for(1s);  // time for the server to take every request it would take
  const long after = peak_rss_kib(false);
  // Others are served meanwhile.
  EXPECT_EQ(store.get("big").size(), size_t(4) << 20);
  if (before < 0 || after < 0) GTEST_SKIP() << "no /proc/self/status here";
  EXPECT_LT(after - before, 64 * 1024) << "peak RSS grew from " << before << " KiB to " << after
                                       << " KiB while a peer pipelined 64 gets of 4 MiB";
}

TEST(TCPStore, KeyListsAreBoundedInCount) {
  TCPStoreServer server("127.0.0.1", 0);
  TCPStore store("127.0.0.1", server.port(), false, kTimeout);
  std::vector<std::string> keys(proto::kMaxKeys + 1, "k");
  std::string msg = expect_throw<InvalidArgument>([&] { store.check(keys); });
  expect_contains(msg, "at most 65536 keys");
  // A forged count above the limit (with the bytes to back it) is a bad frame: that connection
  // closes, the server goes on.
  Bytes body;
  wire::Writer w(body);
  w.u64(proto::kMaxKeys + 1);
  for (uint64_t i = 0; i <= proto::kMaxKeys; ++i) w.string("");
  RawSocket forger(server.port());
  forger.send(proto::make_frame(static_cast<uint16_t>(proto::Command::kCheck), body));
  EXPECT_TRUE(forger.sees_eof());
  EXPECT_EQ(server.num_rejected_frames(), 1);
  store.set("a", "1");
  EXPECT_TRUE(store.check({"a"}));
}

TEST(TCPStore, ConnectionsBeyondTheLimitAreClosedAtOnce) {
  test::EnvGuard env(test::EnvVars{{"TDIST_STORE_MAX_CONNECTIONS", "3"}});
  TCPStoreServer server("127.0.0.1", 0);
  std::vector<std::unique_ptr<RawSocket>> held;
  for (int i = 0; i < 3; ++i) held.push_back(std::make_unique<RawSocket>(server.port()));
  ASSERT_TRUE(eventually([&] { return server.num_connections() == 3; }));
  RawSocket extra(server.port(), /*handshake=*/false);
  EXPECT_TRUE(extra.sees_eof());
  EXPECT_GE(server.num_refused_connections(), 1);
  EXPECT_EQ(server.num_connections(), 3);
  // Once the holders go, real clients are served.
  held.clear();
  ASSERT_TRUE(eventually([&] { return server.num_connections() == 0; }));
  TCPStore store("127.0.0.1", server.port(), false, kTimeout);
  store.set("k", "v");
  EXPECT_EQ(store.get_string("k"), "v");
}

// Note [TCPStore protocol], limits: a write past TDIST_STORE_MAX_KEYS or TDIST_STORE_MAX_BYTES is
// refused with InvalidArgument naming the limit; what is stored stays, the connection stays usable.
TEST(TCPStore, WritesPastTheKeyAndByteLimitsAreRefusedAndNothingIsLost) {
  test::EnvGuard env(
      test::EnvVars{{"TDIST_STORE_MAX_KEYS", "3"}, {"TDIST_STORE_MAX_BYTES", "1000"}});
  TCPStoreServer server("127.0.0.1", 0);
  TCPStore store("127.0.0.1", server.port(), false, kTimeout);
  store.set("a", "1");
  store.set("b", "2");
  EXPECT_EQ(store.add("c", 5), 5);
  expect_contains(expect_throw<InvalidArgument>([&] { store.set("d", "4"); }),
                  "holds 3 keys, its limit (TDIST_STORE_MAX_KEYS)");
  expect_contains(expect_throw<InvalidArgument>([&] { store.add("e", 1); }),
                  "TDIST_STORE_MAX_KEYS");
  expect_contains(
      expect_throw<InvalidArgument>([&] { store.compare_set("f", Bytes{}, to_bytes("x")); }),
      "TDIST_STORE_MAX_KEYS");
  store.set("a", "changed");  // an existing key may change
  EXPECT_EQ(store.add("c", 1), 6);
  expect_contains(expect_throw<InvalidArgument>([&] { store.set("b", std::string(1000, 'x')); }),
                  "would pass its limit of 1000 (TDIST_STORE_MAX_BYTES)");
  EXPECT_EQ(store.get_string("b"), "2") << "a refused write changes nothing";
  EXPECT_EQ(store.num_keys(), 3);
  EXPECT_TRUE(store.delete_key("b"));
  store.set("d", std::string(900, 'y'));  // room again, in keys and in bytes
  EXPECT_EQ(store.get_string("d").size(), 900u);
  EXPECT_EQ(store.get_string("a"), "changed");
}

// TCPStoreServerOptions (core/tcp_store.h): a field that is set wins over its variable, an unset
// one takes the variable; a field out of range is refused naming it, and no server starts.
TEST(TCPStore, ServerOptionsWinOverTheirVariablesAndABadOneIsRefused) {
  test::EnvGuard env(
      test::EnvVars{{"TDIST_STORE_MAX_KEYS", "1"}, {"TDIST_STORE_MAX_BYTES", "1000"}});
  TCPStoreOptions o;
  o.is_server = true;
  o.timeout = kTimeout;
  o.server.max_keys =
      2;  // the field wins over TDIST_STORE_MAX_KEYS=1; max_bytes takes its variable
  TCPStore store(o);
  store.set("a", "1");
  store.set("b", "2");
  expect_contains(expect_throw<InvalidArgument>([&] { store.set("c", "3"); }),
                  "holds 2 keys, its limit (TDIST_STORE_MAX_KEYS)");
  expect_contains(expect_throw<InvalidArgument>([&] { store.set("a", std::string(1000, 'x')); }),
                  "would pass its limit of 1000 (TDIST_STORE_MAX_BYTES)");

  TCPStoreServerOptions bad;
  bad.max_handshakes_per_address = 0;
  expect_contains(expect_throw<InvalidArgument>([&] { TCPStoreServer("127.0.0.1", 0, bad); }),
                  "TCPStoreServerOptions::max_handshakes_per_address must be in [1, ");
  bad = TCPStoreServerOptions{};
  bad.frame_timeout = Millis(-5);
  expect_contains(expect_throw<InvalidArgument>([&] { TCPStoreServer("127.0.0.1", 0, bad); }),
                  "TCPStoreServerOptions::frame_timeout");
}

// A peer that stops inside a frame (in its header or its body) loses its connection after
// TDIST_STORE_FRAME_TIMEOUT_MS, logged once; a client idle between frames keeps its connection,
// and a real client is served throughout.
TEST(TCPStore, APeerStalledInsideAFrameLosesItsConnection) {
  test::EnvGuard env(test::EnvVars{{"TDIST_STORE_FRAME_TIMEOUT_MS", "300"}});
  const LogLevel saved = log_level();
  if (!log_enabled(LogLevel::kError)) set_log_level(LogLevel::kError);
  TCPStoreServer server("127.0.0.1", 0);
  TCPStore store("127.0.0.1", server.port(), false, kTimeout);
  store.set("k", "v");
  ::testing::internal::CaptureStderr();
  RawSocket in_header(server.port());
  const Bytes whole_header = header(proto::kMagic, proto::kVersion, 1, 0);
  in_header.send(Bytes(whole_header.begin(), whole_header.begin() + 5));
  Bytes body_frame = header(proto::kMagic, proto::kVersion, 1, 100);
  body_frame.resize(body_frame.size() + 10);
  RawSocket in_body(server.port());
  in_body.send(body_frame);
  RawSocket idle(server.port());
  idle.send(proto::make_frame(static_cast<uint16_t>(proto::Command::kNumKeys), {}));
  EXPECT_EQ(store.get_string("k"), "v") << "the stalled peers hold up no one";
  EXPECT_TRUE(in_header.sees_eof(5s)) << "stalled inside a header, still connected";
  EXPECT_TRUE(in_body.sees_eof(5s)) << "stalled inside a body, still connected";
  EXPECT_TRUE(eventually([&] { return server.num_rejected_frames() == 2; }));
  std::string log = ::testing::internal::GetCapturedStderr();
  set_log_level(saved);
  expect_contains(log,
                  "stalled inside a frame for 0.3 s (TDIST_STORE_FRAME_TIMEOUT_MS), after 5 "
                  "of 16 header bytes");
  expect_contains(log, "in the 100-byte body of 'set'");
  EXPECT_FALSE(idle.sees_eof(Millis(600))) << "a connection idle between frames was closed";
  EXPECT_EQ(server.num_rejected_frames(), 2);
  EXPECT_EQ(store.get_string("k"), "v");
}

TEST(TCPStore, ConnectRetriesUntilTheServerStarts) {
  const uint16_t port = free_port();
  std::unique_ptr<TCPStoreServer> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(300ms);
    server = std::make_unique<TCPStoreServer>("127.0.0.1", port);
  });
  TCPStore client("127.0.0.1", port, false, kTimeout);
  starter.join();
  client.set("k", "v");
  EXPECT_EQ(client.get_string("k"), "v");
}

TEST(TCPStore, ConnectTimeoutNamesTheAddress) {
  const uint16_t port = free_port();
  std::string msg = expect_throw<NetworkError>([&] { TCPStore("127.0.0.1", port, false, 500ms); });
  expect_contains(msg, "127.0.0.1:" + std::to_string(port));
  expect_contains(msg, "0.5 s");
}

// IPv6 addresses are bracketed in messages (a port after "::1:" would read as part of the
// address); a host that does not resolve fails at once, even with no connect timeout (a retry
// would wait forever).
TEST(TCPStore, ConnectErrorsBracketIpv6AndUnknownHostsFailAtOnce) {
  const uint16_t port = free_port();
  std::string msg = expect_throw<NetworkError>([&] { TCPStore("::1", port, false, 300ms); });
  expect_contains(msg, "[::1]:" + std::to_string(port));
  msg = expect_throw<NetworkError>(
      [&] { TCPStore("no-such-host.invalid", port, false, Store::kNoTimeout); });
  expect_contains(msg, "cannot resolve host 'no-such-host.invalid'");
}

TEST(TCPStore, NumWorkersWaitsForEveryStore) {
  TCPStoreServer server("127.0.0.1", 0);
  constexpr int kWorkers = 3;
  std::atomic<int> joined{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kWorkers; ++i) {
    threads.emplace_back([&] {
      try {
        TCPStoreOptions opts;
        opts.port = server.port();
        opts.num_workers = kWorkers;
        opts.timeout = kTimeout;
        TCPStore store(opts);
        joined++;
        store.add("after-join", 1);
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(joined.load(), kWorkers);
  TCPStore observer("127.0.0.1", server.port(), false, kTimeout);
  EXPECT_EQ(observer.get_string("after-join"), std::to_string(kWorkers));
  // The join bookkeeping is not counted as user keys.
  EXPECT_EQ(observer.num_keys(), 1);
}

TEST(TCPStore, NumWorkersTimeoutSaysHowManyJoined) {
  TCPStoreOptions opts;
  opts.is_server = true;
  opts.num_workers = 3;
  opts.timeout = 500ms;
  std::string msg = expect_throw<TimeoutError>([&] { TCPStore store(opts); });
  expect_contains(msg, "1 of 3 joined");
  expect_contains(msg, "0.5 s");
}

// ---- malformed frames from a raw socket -----------------------------------------------------

struct BadFrame {
  std::string name;
  std::function<void(RawSocket&)> send;
  std::string logged;  // a fragment of the logged reason
};

std::ostream& operator<<(std::ostream& os, const BadFrame& b) { return os << b.name; }

Bytes set_with_lying_key_length() {
  Bytes body;
  wire::Writer w(body);
  w.u64(1000);  // the key claims 1000 bytes; 2 follow
  w.raw("ab", 2);
  return proto::make_frame(static_cast<uint16_t>(proto::Command::kSet), body);
}

const BadFrame kBadFrames[] = {
    {"Garbage", [](RawSocket& s) { s.send(to_bytes("GET / HTTP/1.1\r\nHost: x\r\n\r\n")); },
     "bad magic"},
    {"WrongMagic", [](RawSocket& s) { s.send(header(0xdeadbeef, proto::kVersion, 1, 0)); },
     "bad magic"},
    {"WrongVersion", [](RawSocket& s) { s.send(header(proto::kMagic, 99, 1, 0)); },
     "unsupported protocol version 99"},
    {"BodyLength2Pow62",
     [](RawSocket& s) { s.send(header(proto::kMagic, proto::kVersion, 1, uint64_t(1) << 62)); },
     "exceeds the limit"},
    {"BodyLengthJustOverLimit",
     [](RawSocket& s) {
       s.send(header(proto::kMagic, proto::kVersion, 1, TCPStoreServer::kMaxFrameBytes + 1));
     },
     "exceeds the limit"},
    {"UnknownCommand", [](RawSocket& s) { s.send(header(proto::kMagic, proto::kVersion, 999, 0)); },
     "unknown command 999"},
    {"LyingLengthInsideTheBody", [](RawSocket& s) { s.send(set_with_lying_key_length()); },
     "malformed 'set' request"},
    {"TrailingBytes",
     [](RawSocket& s) {
       s.send(proto::make_frame(static_cast<uint16_t>(proto::Command::kNumKeys), {1, 2, 3}));
     },
     "trailing bytes"},
    {"TruncatedHeader",
     [](RawSocket& s) {
       s.send({0x54, 0x44, 0x53});
       s.shutdown_write();
     },
     "inside a frame header"},
    {"TruncatedBody",
     [](RawSocket& s) {
       Bytes frame = header(proto::kMagic, proto::kVersion, 1, 100);
       frame.resize(frame.size() + 10);
       s.send(frame);
       s.shutdown_write();
     },
     "inside the body"},
    {"SecondRequestWhileOneIsParked",
     [](RawSocket& s) {
       s.send(wait_frame("never", Millis(0)));
       s.send(wait_frame("never", Millis(0)));
     },
     "still pending"},
};

class TCPStoreBadFrame : public ::testing::TestWithParam<BadFrame> {};

TEST_P(TCPStoreBadFrame, ClosesOnlyThatConnectionAndIsLogged) {
  const LogLevel saved = log_level();
  if (!log_enabled(LogLevel::kError)) set_log_level(LogLevel::kError);
  TCPStoreServer server("127.0.0.1", 0);
  TCPStore client("127.0.0.1", server.port(), false, kTimeout);
  client.set("before", "1");
  EXPECT_EQ(client.get_string("before"), "1");

  ::testing::internal::CaptureStderr();
  {
    RawSocket raw(server.port());
    GetParam().send(raw);
    EXPECT_TRUE(raw.sees_eof()) << "the server did not close the offending connection";
  }
  bool rejected = eventually([&] { return server.num_rejected_frames() == 1; });
  std::string log = ::testing::internal::GetCapturedStderr();
  set_log_level(saved);
  EXPECT_TRUE(rejected) << server.num_rejected_frames();
  expect_contains(log, "closing the connection");
  expect_contains(log, GetParam().logged);

  // The normal client keeps working, on its existing connection and on new ones.
  client.set("after", "2");
  EXPECT_EQ(client.get_string("before"), "1");
  EXPECT_EQ(client.get_string("after"), "2");
  TCPStore fresh("127.0.0.1", server.port(), false, kTimeout);
  EXPECT_EQ(fresh.num_keys(), 2);
}

INSTANTIATE_TEST_SUITE_P(Frames, TCPStoreBadFrame, ::testing::ValuesIn(kBadFrames),
                         [](const auto& info) { return info.param.name; });

// ---- real processes -------------------------------------------------------------------------

uint16_t master_port() { return static_cast<uint16_t>(env::require_int("MASTER_PORT", 1, 65535)); }

TDIST_TEST_CHILD(tcp_store_worker) {
  TCPStore store("127.0.0.1", master_port(), false, 30s);
  if (int rc = test::exercise_store(store, rank, world_size, 100); rc != 0) return rc;
  store.add("done", 1);
  return 0;
}

TEST(TCPStoreProcesses, FourProcessesAddSetAndWait) {
  TCPStore server("127.0.0.1", 0, true, kTimeout);
  test::Processes procs("tcp_store_worker", 4, {{"MASTER_PORT", std::to_string(server.port())}});
  auto results = procs.wait_all(60s);
  ASSERT_EQ(test::Processes::failures(results), "");
  EXPECT_EQ(server.get_string("counter"), "400");
  EXPECT_EQ(server.get_string("done"), "4");
  const std::string leader = server.get_string("leader");
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(server.get_string("leader_seen/" + std::to_string(r)), leader);
  }
}

TDIST_TEST_CHILD(tcp_store_blocked_waiter) {
  TCPStore store("127.0.0.1", master_port(), false, 60s);
  store.set("ready/" + std::to_string(rank), "1");
  store.wait({"never"});  // killed while parked here
  return 3;
}

TEST(TCPStoreProcesses, KilledChildrenMidWaitDoNotStopTheServer) {
  TCPStore server("127.0.0.1", 0, true, kTimeout);
  test::Processes procs("tcp_store_blocked_waiter", 2,
                        {{"MASTER_PORT", std::to_string(server.port())}});
  server.wait({"ready/0", "ready/1"});
  procs.kill(0, SIGKILL);
  procs.kill(1, SIGKILL);
  auto results = procs.wait_all(30s);
  for (const auto& r : results) EXPECT_FALSE(r.ok()) << r.describe();
  // Only the server's own client connection remains.
  EXPECT_TRUE(eventually([&] { return server.server()->num_connections() == 1; }))
      << server.server()->num_connections();
  server.set("never", "now");
  EXPECT_EQ(server.get_string("never"), "now");
  EXPECT_EQ(server.server()->num_rejected_frames(), 0);
}

}  // namespace
}  // namespace tdist
