// The address an RPC agent listens on and publishes (core/net/address.h, shared with the
// collective mesh): agents meet at a TCPStore on ::1, on localhost and on this host's own
// non-loopback address, with the address picked for them (RpcOptions::listen_host empty) or
// given (an IPv6 literal, a host name), and call each other. tests/apps/ipv6_test.sh runs the
// same across IPv6-only hosts.
#include <gtest/gtest.h>

#include "tdist/core/logging.h"
#include "tdist/core/net/address.h"
#include "tdist/core/serialize.h"
#include "tdist/core/tcp_store.h"
#include "tests/harness/env_guard.h"
#include "tests/harness/expect.h"
#include "tests/rpc/rpc_test_util.h"

namespace tdist::rpc::test {
namespace {

// Why this host cannot listen on ::1 (IPv6 off, or no IPv6 loopback); empty when it can.
std::string no_ipv6_loopback() {
  try {
    net::Listener probe("::1", 0, 1);
    return {};
  } catch (const NetworkError& e) {
    return e.what();
  }
}

// Two agents (threads), each with its own client of a TCPStore server at store_host, listening
// on `listen_host` (empty: picked), each calling the other. Returns the hosts they published.
std::vector<std::string> two_agents_call(const std::string& store_host,
                                         const std::string& listen_host) {
  register_test_functions();
  TCPStore server(store_host, 0, true, 30s);
  std::vector<std::shared_ptr<RpcAgent>> agents(2);
  std::vector<std::thread> threads;
  std::mutex mu;
  std::exception_ptr first;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        RpcOptions o;
        o.store = std::make_shared<TCPStore>(store_host, server.port(), false, 30s);
        o.listen_host = listen_host;
        o.rpc_timeout = 30s;
        agents[r] = RpcAgent::start("a" + std::to_string(r), r, 2, o);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
  EXPECT_EQ(agents[0]->rpc_sync<int64_t>("a1", "add", int64_t{40}, int64_t{2}), 42);
  EXPECT_EQ(agents[1]->rpc_sync<int64_t>("a0", "add", int64_t{1}, int64_t{2}), 3);
  std::vector<std::string> hosts{agents[0]->host(), agents[1]->host()};
  std::vector<std::thread> stops;
  for (auto& a : agents) stops.emplace_back([&a] { a->shutdown(true); });
  for (auto& t : stops) t.join();
  return hosts;
}

TEST(RpcAddress, AStoreAtIpv6LoopbackWithThePickedAddress) {
  if (auto why = no_ipv6_loopback(); !why.empty()) GTEST_SKIP() << "no IPv6 loopback: " << why;
  const auto hosts = two_agents_call("::1", "");
  // The address the collective mesh would publish toward the same store.
  EXPECT_EQ(hosts[0], net::local_address("::1"));
  EXPECT_EQ(hosts[1], hosts[0]);
}

TEST(RpcAddress, AnIpv6ListenHostIsUsedAsGiven) {
  if (auto why = no_ipv6_loopback(); !why.empty()) GTEST_SKIP() << "no IPv6 loopback: " << why;
  const auto hosts = two_agents_call("::1", "::1");
  EXPECT_EQ(hosts[0], "::1");
  EXPECT_EQ(hosts[1], "::1");
}

TEST(RpcAddress, AStoreAtLocalhostWithThePickedAddress) {
  const auto hosts = two_agents_call("localhost", "");
  EXPECT_EQ(hosts[0], net::local_address("localhost"));
}

// A host name is published as it is and resolved by the peer that connects.
TEST(RpcAddress, AHostNameListenHostIsPublishedAndResolved) {
  const auto hosts = two_agents_call("localhost", "localhost");
  EXPECT_EQ(hosts[0], "localhost");
  EXPECT_EQ(hosts[1], "localhost");
}

// A store at a non-loopback address of this host: the agents publish the address of the
// interface that routes to it (that one), not loopback, so peers on other hosts could reach them.
TEST(RpcAddress, AStoreAtANonLoopbackAddressGivesThatInterfacesAddress) {
  const std::string own = net::local_address();
  if (net::is_loopback_host(own)) {
    GTEST_SKIP() << "this host has no non-loopback interface up (local_address() = " << own
                 << "); tests/apps/ipv6_test.sh covers it on namespace hosts";
  }
  // A store beyond loopback needs the job's token (issue 41, item 5).
  tdist::test::EnvGuard token(tdist::test::EnvVars{{"TDIST_TOKEN", "rpc-address-test"},
                                                   {"TDIST_TOKEN_FILE", std::nullopt}});
  const auto hosts = two_agents_call(own, "");
  EXPECT_EQ(hosts[0], own);
  EXPECT_EQ(hosts[1], own);
  EXPECT_FALSE(net::is_loopback_host(hosts[0])) << hosts[0];
}

TEST(RpcAddress, AListenHostThatDoesNotResolveFailsStartNamingWorkerAndHost) {
  // Beyond loopback, so with a token (else the refusal below comes first).
  tdist::test::EnvGuard token(tdist::test::EnvVars{{"TDIST_TOKEN", "rpc-address-test"},
                                                   {"TDIST_TOKEN_FILE", std::nullopt}});
  RpcOptions o;
  o.store = std::make_shared<HashStore>(10000ms);
  o.listen_host = "no-such-host.invalid";
  try {
    RpcAgent::start("w0", 0, 1, o);
    FAIL() << "an agent started on a host name that does not resolve";
  } catch (const NetworkError& e) {
    EXPECT_NE(std::string(e.what()).find("worker 'w0'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("no-such-host.invalid"), std::string::npos) << e.what();
  }
}

// Secure by default (issue 41, item 5; Note [Secure by default] in core/token.h): an agent that
// would listen beyond loopback (this host's LAN address, or the wildcard) without a token
// refuses to start, naming the worker, the address and the ways out, whatever its store (here a
// HashStore, which names no network host); TDIST_ALLOW_NO_TOKEN=1 lets it start with one loud
// warning; loopback needs no token.
TEST(RpcAddress, AnAgentBeyondLoopbackWithoutATokenRefusesToStartUnlessAllowed) {
  const std::string own = net::local_address();
  if (net::is_loopback_host(own)) {
    GTEST_SKIP() << "this host has no non-loopback interface up (local_address() = " << own << ")";
  }
  tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_TOKEN", std::nullopt},
                                                 {"TDIST_TOKEN_FILE", std::nullopt},
                                                 {"TDIST_ALLOW_NO_TOKEN", std::nullopt}});
  register_test_functions();
  auto start = [](const std::string& host) {
    RpcOptions o;
    o.store = std::make_shared<HashStore>(10000ms);
    o.listen_host = host;
    return RpcAgent::start("w0", 0, 1, o);
  };
  for (const std::string& host : {own, std::string("0.0.0.0")}) {
    const std::string msg = tdist::test::expect_throw<InvalidArgument>([&] { start(host); });
    tdist::test::expect_contains(msg, "the RPC agent of worker 'w0'");
    tdist::test::expect_contains(msg, host);
    tdist::test::expect_contains(msg, "without a token");
    tdist::test::expect_contains(msg, "TDIST_ALLOW_NO_TOKEN=1");
  }
  {
    auto loopback = start("127.0.0.1");
    EXPECT_EQ(loopback->rpc_sync<int64_t>(0, "add", int64_t{2}, int64_t{3}), 5);
    loopback->shutdown(true);
  }
  tdist::test::EnvGuard allow(tdist::test::EnvVars{{"TDIST_ALLOW_NO_TOKEN", "1"}});
  const LogLevel saved = log_level();
  set_log_level(LogLevel::kWarn);
  ::testing::internal::CaptureStderr();
  for (int round = 0; round < 2; ++round) {
    auto agent = start(own);
    EXPECT_EQ(agent->host(), own);
    EXPECT_EQ(agent->rpc_sync<int64_t>(0, "add", int64_t{1}, int64_t{1}), 2);
    agent->shutdown(true);
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  set_log_level(saved);
  tdist::test::expect_contains(log, "WITHOUT A TOKEN");
  EXPECT_EQ(log.find("WITHOUT A TOKEN"), log.rfind("WITHOUT A TOKEN"))
      << "said more than once: " << log;
}

// A peer that published a host name that does not resolve: calls to it fail (retried until
// their deadline, like any connect), and the agent still serves the others.
TEST(RpcAddress, APeerAtAHostThatDoesNotResolveFailsItsCalls) {
  register_test_functions();
  auto store = std::make_shared<HashStore>(30000ms);
  store->set("tdist_rpc/1/worker/1",
             encode(std::string("ghost"), std::string("no-such-host.invalid"), uint16_t{1}));
  RpcOptions o;
  o.store = store;
  o.listen_host = "127.0.0.1";
  o.rpc_timeout = 300ms;
  auto agent = RpcAgent::start("w0", 0, 2, o);
  auto f = agent->rpc_async<int64_t>(1, "add", Timeout{Millis(1000)}, int64_t{1}, int64_t{1});
  ASSERT_TRUE(eventually([&] { return f.done(); }, 20s)) << "the call outlived its deadline";
  EXPECT_THROW(f.wait(), Error);
  EXPECT_EQ(agent->rpc_sync<int64_t>(0, "add", int64_t{2}, int64_t{3}), 5);
  agent->shutdown(false);
}

}  // namespace
}  // namespace tdist::rpc::test
