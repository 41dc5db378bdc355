// The connection handshake (core/net/handshake.h): its messages checked in memory, then the
// store's port under hostile clients (the mesh's and RPC's ports have the same tests in
// tests/comm/failure_test.cpp and tests/rpc/rpc_security_test.cpp).

#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/net/address.h"
#include "tdist/core/net/handshake.h"
#include "tdist/core/tcp_store.h"
#include "tests/harness/env_guard.h"
#include "tests/harness/expect.h"
#include "tests/harness/handshake_attacks.h"

namespace tdist {
namespace {

using namespace std::chrono_literals;
using net::ClientHandshake;
using net::ServerHandshake;
using net::Service;
using test::expect_contains;
using test::expect_throw;

// The four messages between a client and a server keyed with the given tokens, in memory.
struct Exchange {
  ServerHandshake server;
  ClientHandshake client;
  Exchange(const std::string& server_token, const std::string& client_token,
           Service service = Service::kRpc)
      : server(server_token, service), client(client_token, service) {}
  Bytes hello(const Bytes& fields) {
    return client.hello(server.challenge().data(), server.challenge().size(), fields);
  }
};

TEST(Handshake, BothSidesAuthenticateAndCarryTheirFields) {
  Exchange x("secret", "secret");
  const Bytes hello = x.hello({1, 2, 3});
  EXPECT_EQ(hello.size(), net::hello_bytes(3));
  EXPECT_EQ(x.server.verify_hello(hello.data(), hello.size(), 3), (Bytes{1, 2, 3}));
  const Bytes accept = x.server.accept({4, 5});
  EXPECT_EQ(x.client.verify_accept(accept.data(), accept.size(), 2), (Bytes{4, 5}));
  const Bytes confirm = x.client.confirm({6});
  EXPECT_EQ(x.server.verify_confirm(confirm.data(), confirm.size(), 1), Bytes{6});
}

TEST(Handshake, TheTokenNeverTravels) {
  Exchange x("a-rather-long-secret", "a-rather-long-secret");
  const Bytes hello = x.hello({});
  x.server.verify_hello(hello.data(), hello.size(), 0);
  const Bytes accept = x.server.accept({});
  for (const Bytes* m : {&x.server.challenge(), &hello, &accept}) {
    const std::string bytes(m->begin(), m->end());
    EXPECT_EQ(bytes.find("rather"), std::string::npos);
  }
}

TEST(Handshake, AWrongOrMissingTokenFailsOnTheServer) {
  for (const std::string token : {"other", ""}) {
    Exchange x("secret", token);
    const Bytes hello = x.hello({});
    expect_contains(
        expect_throw<ProtocolError>([&] { x.server.verify_hello(hello.data(), hello.size(), 0); }),
        "authentication failed (wrong or missing token)");
    EXPECT_THROW(x.server.accept({}), Error) << "no acceptance before the hello verified";
  }
}

TEST(Handshake, AReplayedHelloOrAcceptanceFailsOnANewConnection) {
  Exchange first("secret", "secret");
  const Bytes hello = first.hello({7});
  first.server.verify_hello(hello.data(), hello.size(), 1);
  const Bytes accept = first.server.accept({8});
  // The same bytes on a second connection: other nonces, so the MACs no longer verify.
  Exchange second("secret", "secret");
  EXPECT_THROW(second.server.verify_hello(hello.data(), hello.size(), 1), ProtocolError);
  (void)second.hello({7});
  EXPECT_THROW(second.client.verify_accept(accept.data(), accept.size(), 1), ProtocolError);
}

TEST(Handshake, ChangedFieldsFailTheMacOnEitherSide) {
  Exchange x("secret", "secret");
  Bytes hello = x.hello({1, 2, 3});
  hello[net::hello_bytes(0) - net::kMacBytes + 1] ^= 1;  // the second field byte
  EXPECT_THROW(x.server.verify_hello(hello.data(), hello.size(), 3), ProtocolError);
  hello[net::hello_bytes(0) - net::kMacBytes + 1] ^= 1;
  x.server.verify_hello(hello.data(), hello.size(), 3);
  Bytes accept = x.server.accept({4});
  accept[4] ^= 1;  // the server's field, as a man in the middle would change it
  expect_contains(
      expect_throw<ProtocolError>([&] { x.client.verify_accept(accept.data(), accept.size(), 1); }),
      "the server failed authentication (wrong or missing token)");
}

TEST(Handshake, AnotherServiceOrSizeIsRefusedByName) {
  ServerHandshake mesh("secret", Service::kMesh);
  ClientHandshake store_client("secret", Service::kStore);
  expect_contains(expect_throw<ProtocolError>([&] {
                    store_client.hello(mesh.challenge().data(), mesh.challenge().size(), {});
                  }),
                  "the peer speaks to a collective mesh port, this is a store port");
  Exchange x("secret", "secret", Service::kStore);
  const Bytes hello = x.hello({});
  expect_contains(expect_throw<ProtocolError>(
                      [&] { x.server.verify_hello(hello.data(), hello.size() - 1, 0); }),
                  "the hello has 71 bytes, not 72");
  Bytes junk(net::hello_bytes(0), 'x');
  expect_contains(
      expect_throw<ProtocolError>([&] { x.server.verify_hello(junk.data(), junk.size(), 0); }),
      "bad magic");
}

// Reflection (issue 41, item 14): whoever answers at a peer's address hands the client the
// challenge of its own endpoint's server and relays the HELLO back. On 4622ec6 nothing stopped
// it: the client signed its own server's challenge, and the server took the relayed HELLO as a
// peer's. A client given its endpoint's IssuedChallenges refuses such a challenge, while the
// server handshake (or a copy of it) lives; a client of another endpoint (another rank, in this
// process or not) and a connection to itself (no IssuedChallenges) still go through.
TEST(Handshake, AClientRefusesTheChallengeOfItsOwnEndpointsServer) {
  auto issued = std::make_shared<net::IssuedChallenges>();
  auto server = std::make_unique<ServerHandshake>("secret", Service::kRpc, issued);
  const Bytes challenge = server->challenge();
  {
    // What the reflection exploits: a HELLO signed for our own challenge verifies at our server.
    ClientHandshake unguarded("secret", Service::kRpc);
    const Bytes hello = unguarded.hello(challenge.data(), challenge.size(), {7});
    EXPECT_EQ(server->verify_hello(hello.data(), hello.size(), 1), Bytes{7});
  }
  ClientHandshake guarded("secret", Service::kRpc, issued);
  expect_contains(
      expect_throw<ProtocolError>([&] { guarded.hello(challenge.data(), challenge.size(), {7}); }),
      "the RPC challenge came from this endpoint's own server");
  EXPECT_TRUE(issued->issued(challenge.data(), challenge.size()));
  // Another endpoint's challenges are answered.
  ServerHandshake other("secret", Service::kRpc, std::make_shared<net::IssuedChallenges>());
  ClientHandshake ours("secret", Service::kRpc, issued);
  EXPECT_EQ(ours.hello(other.challenge().data(), other.challenge().size(), {7}).size(),
            net::hello_bytes(1));
  // A copy keeps the challenge issued after the original is gone.
  const ServerHandshake copy = *server;
  server.reset();
  EXPECT_TRUE(issued->issued(challenge.data(), challenge.size()));
}

TEST(Handshake, AChallengeIsIssuedOnlyWhileItsHandshakeLives) {
  auto issued = std::make_shared<net::IssuedChallenges>();
  Bytes challenge;
  {
    ServerHandshake server("secret", Service::kRpc, issued);
    challenge = server.challenge();
    EXPECT_TRUE(issued->issued(challenge.data(), challenge.size()));
  }
  EXPECT_FALSE(issued->issued(challenge.data(), challenge.size()));
  ClientHandshake client("secret", Service::kRpc, issued);
  EXPECT_EQ(client.hello(challenge.data(), challenge.size(), {}).size(), net::hello_bytes(0));
  EXPECT_FALSE(issued->issued(challenge.data(), challenge.size() - 1));  // not a challenge
}

// ---- the store's port ---------------------------------------------------------------------------

using test::kTimeout;

TEST(TCPStoreAuth, ClientsWithTheTokenAreServedOthersAreRefusedAtOnce) {
  const LogLevel saved = log_level();
  set_log_level(LogLevel::kOff);
  TCPStoreOptions server_options;
  server_options.is_server = true;
  server_options.token = "s3cret";
  TCPStore server_store(server_options);
  TCPStoreOptions o;
  o.port = server_store.port();
  o.token = "s3cret";
  TCPStore good(o);
  good.set("k", "v");
  for (const std::string token : {"wrong", ""}) {
    o.token = token;
    const auto start = std::chrono::steady_clock::now();
    expect_contains(expect_throw<ProtocolError>([&] { TCPStore bad(o); }),
                    "refused this connection: is the token the same on every process?");
    EXPECT_LT(std::chrono::steady_clock::now() - start, kTimeout) << "refusals are not retried";
  }
  EXPECT_EQ(server_store.server()->num_failed_handshakes(), 2);
  EXPECT_EQ(good.get_string("k"), "v");
  set_log_level(saved);
}

TEST(TCPStoreAuth, TheTokenComesFromTheEnvironmentWhenNotGiven) {
  test::EnvGuard env(
      test::EnvVars{{"TDIST_TOKEN", std::string("from-env")}, {"TDIST_TOKEN_FILE", std::nullopt}});
  const LogLevel saved = log_level();
  set_log_level(LogLevel::kOff);
  TCPStoreServer server("127.0.0.1", 0);
  TCPStore store("127.0.0.1", server.port(), false, kTimeout);
  store.set("k", "v");
  test::HandshakePort port{"127.0.0.1", server.port(), Service::kStore, 0};
  EXPECT_TRUE(test::refuses_token(port, ""));
  EXPECT_TRUE(test::refuses_token(port, "from-env!"));
  EXPECT_EQ(store.get_string("k"), "v");
  set_log_level(saved);
}

TEST(TCPStoreAuth, StrangersReplaysAndStallsAreRefusedAndTheStoreGoesOn) {
  test::EnvGuard env(test::EnvVars{{"TDIST_STORE_HANDSHAKE_TIMEOUT_MS", std::string("300")}});
  const LogLevel saved = log_level();
  set_log_level(LogLevel::kWarn);
  ::testing::internal::CaptureStderr();
  TCPStoreServer server("127.0.0.1", 0, std::string("s3cret"));
  TCPStoreOptions o;
  o.port = server.port();
  o.token = "s3cret";
  TCPStore store(o);
  store.set("k", "v");
  test::HandshakePort port{"127.0.0.1", server.port(), Service::kStore, 0};
  EXPECT_TRUE(test::refuses_token(port, ""));
  EXPECT_TRUE(test::refuses_token(port, "wrong"));
  EXPECT_TRUE(test::refuses_replayed_hello(port, "s3cret"));
  const int stalled = test::stalled_handshake(port, "s3cret");
  EXPECT_EQ(store.get_string("k"), "v") << "the stalled client holds up no one";
  EXPECT_TRUE(test::closed_within(stalled, 5s)) << "a stalled handshake kept its connection";
  ::close(stalled);
  EXPECT_EQ(server.num_failed_handshakes(), 4);
  store.set("k", "w");
  EXPECT_EQ(store.get_string("k"), "w");
  const std::string log = ::testing::internal::GetCapturedStderr();
  set_log_level(saved);
  expect_contains(log, "authentication failed (wrong or missing token)");
  expect_contains(log,
                  "the handshake was not over within 0.3 s (TDIST_STORE_HANDSHAKE_TIMEOUT_MS)");
}

// Secure by default (issue 41, item 5): a store server that would listen beyond loopback
// without a token refuses to start, naming the way out; TDIST_ALLOW_NO_TOKEN=1 lets it start
// with one loud warning per process. Loopback needs no token, and a token is always enough.
TEST(TCPStoreAuth, AServerBeyondLoopbackWithoutATokenRefusesToStartUnlessAllowed) {
  test::EnvGuard env(test::EnvVars{{"TDIST_TOKEN", std::nullopt},
                                   {"TDIST_TOKEN_FILE", std::nullopt},
                                   {"TDIST_ALLOW_NO_TOKEN", std::nullopt}});
  const std::string msg = expect_throw<InvalidArgument>([] { TCPStoreServer("0.0.0.0", 0); });
  expect_contains(msg, "0.0.0.0");
  expect_contains(msg, "without a token");
  expect_contains(msg, "TDIST_ALLOW_NO_TOKEN=1");
  { TCPStoreServer loopback("127.0.0.1", 0); }
  { TCPStoreServer with_token("0.0.0.0", 0, std::string("s3cret")); }
  test::EnvGuard allow(test::EnvVars{{"TDIST_ALLOW_NO_TOKEN", "1"}});
  const LogLevel saved = log_level();
  set_log_level(LogLevel::kWarn);
  ::testing::internal::CaptureStderr();
  { TCPStoreServer first("0.0.0.0", 0); }
  { TCPStoreServer second("0.0.0.0", 0); }
  const std::string log = ::testing::internal::GetCapturedStderr();
  set_log_level(saved);
  expect_contains(log, "WITHOUT A TOKEN");
  EXPECT_EQ(log.find("WITHOUT A TOKEN"), log.rfind("WITHOUT A TOKEN"))
      << "said more than once: " << log;
}

// A job whose store is on loopback is a job of one host: its ranks publish (and the mesh and RPC
// bind) loopback, not the first interface that is up (rule 4 of local_address, up to 5a24577).
TEST(TCPStoreAuth, AStoreOnLoopbackMakesTheRanksPublishLoopback) {
  test::EnvGuard env(test::EnvVars{{"TDIST_SOCKET_HOST", std::nullopt},
                                   {"TDIST_SOCKET_IFNAME", std::nullopt},
                                   {"GLOO_SOCKET_IFNAME", std::nullopt}});
  EXPECT_EQ(net::local_address("127.0.0.1"), "127.0.0.1");
  EXPECT_TRUE(net::is_loopback_host(net::local_address("localhost")))
      << net::local_address("localhost");
  EXPECT_TRUE(net::is_loopback_host(net::local_address("::1"))) << net::local_address("::1");
}

}  // namespace
}  // namespace tdist
