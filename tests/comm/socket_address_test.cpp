// Which address a rank publishes for its peers (docs/comm.md, "Which address a rank publishes"):
// the interface named by TDIST_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, else the one that routes to
// the store's host, else the first non-loopback interface that is up; never loopback while a
// non-loopback interface exists. The multi-host children at the end run on two network
// namespaces (tests/harness/two_hosts.sh), once per init method.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <arpa/inet.h>

#include <iostream>
#include <set>

#include "tdist/comm/process_group.h"
#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/file_store.h"
#include "tdist/core/hash_store.h"
#include "tdist/core/logging.h"
#include "tdist/core/rendezvous.h"
#include "tdist/core/tcp_store.h"
#include "tests/harness/env_guard.h"
#include "tests/harness/expect.h"
#include "tests/harness/process.h"
#include "tests/harness/spawn.h"

namespace tdist::comm {
namespace {

using tdist::test::EnvGuard;

// No address hint from the environment: the choice is the library's own.
const tdist::test::EnvVars kNoHints = {{"TDIST_SOCKET_HOST", std::nullopt},
                                       {"TDIST_SOCKET_IFNAME", std::nullopt},
                                       {"GLOO_SOCKET_IFNAME", std::nullopt},
                                       {"MASTER_ADDR", std::nullopt}};

// The IPv4 addresses of this host's non-loopback interfaces that are up.
std::set<std::string> non_loopback_addresses() {
  std::set<std::string> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    if ((i->ifa_flags & IFF_UP) == 0 || (i->ifa_flags & IFF_LOOPBACK) != 0) continue;
    char text[INET_ADDRSTRLEN] = {0};
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text,
                sizeof(text));
    out.insert(text);
  }
  ::freeifaddrs(list);
  return out;
}

std::string host_of(const std::string& host_port) {
  return host_port.substr(0, host_port.rfind(':'));
}

// Builds a group of `world` ranks (threads) over `store` and returns the host each rank
// published (the mesh's "addr/<rank>" keys of the first group on that store).
// store_of(rank, shared) makes a rank's store (null: the shared in-process store).
using StoreOf = std::function<std::shared_ptr<Store>(int, Store&)>;

std::vector<std::string> published_hosts(const StoreOf& store_of, int world) {
  std::vector<std::string> hosts(world);
  tdist::test::spawn(world, [&](int rank, std::shared_ptr<Store> shared) {
    auto store = store_of ? store_of(rank, *shared) : shared;
    ProcessGroup::Options opts;
    opts.timeout = std::chrono::seconds(20);
    auto pg = create_process_group(store, rank, world, opts);
    at::Tensor t = at::ones({3});
    pg->allreduce(t)->wait();
    EXPECT_EQ(t[0].item<float>(), world);
    hosts[rank] = host_of(store->get_string(str("tdist/pg1/addr/", rank)));
  });
  return hosts;
}

TEST(SocketAddress, IfnameLoopbackPublishesLoopback) {
  for (const char* var : {"TDIST_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}) {
    tdist::test::EnvVars vars = kNoHints;
    vars[var] = "lo";
    EnvGuard env(vars);
    for (const auto& host : published_hosts(nullptr, 2)) EXPECT_EQ(host, "127.0.0.1") << var;
  }
}

TEST(SocketAddress, UnknownIfnameIsAClearError) {
  for (const char* var : {"TDIST_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}) {
    tdist::test::EnvVars vars = kNoHints;
    vars[var] = "nosuchif0";
    EnvGuard env(vars);
    auto store = std::make_shared<HashStore>();
    ProcessGroup::Options opts;
    opts.timeout = std::chrono::seconds(5);
    // World size 2, but the error comes before any peer is needed.
    std::string msg = tdist::test::expect_throw<InvalidArgument>(
        [&] { create_process_group(store, 0, 2, opts); });
    tdist::test::expect_contains(msg, "nosuchif0");
    tdist::test::expect_contains(msg, var);
  }
}

// Without a hint and with a store that names no host (a FileStore, which hosts may share), a
// rank publishes a non-loopback interface (and, beyond loopback, needs the job's token: Note
// [Secure by default]); with an in-process HashStore or a TCPStore on 127.0.0.1 it publishes
// loopback (secure by default, issue 41 item 5: a loopback job does not listen on the LAN; a
// multi-host job names its store by a reachable address: MultiHost.*InitMethod,
// tests/comm/CMakeLists.txt).
TEST(SocketAddress, NoHintPublishesANonLoopbackInterfaceUnlessTheStoreIsOnLoopback) {
  const auto mine = non_loopback_addresses();
  if (mine.empty()) GTEST_SKIP() << "this host has no non-loopback IPv4 interface that is up";
  tdist::test::EnvVars vars = kNoHints;
  vars["TDIST_TOKEN"] = "socket-address-test";
  vars["TDIST_TOKEN_FILE"] = std::nullopt;
  EnvGuard env(vars);
  const std::string path = tdist::test::temp_dir("tdist-sockaddr") + "/store";
  auto file_store = [&](int, Store&) -> std::shared_ptr<Store> {
    return std::make_shared<FileStore>(path, 2, std::chrono::seconds(20));
  };
  for (const auto& host : published_hosts(file_store, 2)) {
    EXPECT_TRUE(mine.count(host)) << "FileStore: published " << host;
  }
  for (const auto& host : published_hosts(nullptr, 2)) {
    EXPECT_EQ(host, "127.0.0.1") << "in-process HashStore: published " << host;
  }
  std::vector<std::shared_ptr<TCPStoreServer>> servers;  // outlive the stores
  // Rank 0 serves on a port the kernel picks and hands it to rank 1 through the shared store.
  auto tcp_store = [&](int rank, Store& shared) -> std::shared_ptr<Store> {
    TCPStoreOptions o;
    o.host = "127.0.0.1";
    o.timeout = std::chrono::seconds(20);
    if (rank == 0) {
      auto server = std::make_shared<TCPStoreServer>(o.host, 0);
      shared.set("port", std::to_string(server->port()));
      o.port = server->port();
      auto store = std::make_shared<TCPStore>(o);
      servers.push_back(server);
      return store;
    }
    o.port = static_cast<uint16_t>(std::stoi(shared.get_string("port")));
    return std::make_shared<TCPStore>(o);
  };
  for (const auto& host : published_hosts(tcp_store, 2)) {
    EXPECT_EQ(host, "127.0.0.1") << "TCPStore on 127.0.0.1: published " << host;
  }
}

// Secure by default (issue 41, item 5; Note [Secure by default] in core/token.h): a mesh that
// would listen beyond loopback without a token refuses to form, decided from the address it
// binds (here over a HashStore, whose group knows no store host, with TDIST_SOCKET_HOST naming
// this host's own LAN address), naming the ways out; TDIST_ALLOW_NO_TOKEN=1 lets it form with one
// loud warning per process; a token lets it form without one; loopback needs none (the test
// above).
TEST(SocketAddress, AMeshBeyondLoopbackWithoutATokenRefusesToFormUnlessAllowed) {
  const auto mine = non_loopback_addresses();
  if (mine.empty()) GTEST_SKIP() << "this host has no non-loopback IPv4 interface that is up";
  const std::string lan = *mine.begin();
  tdist::test::EnvVars vars = kNoHints;
  vars["TDIST_SOCKET_HOST"] = lan;
  vars["TDIST_TOKEN"] = std::nullopt;
  vars["TDIST_TOKEN_FILE"] = std::nullopt;
  vars["TDIST_ALLOW_NO_TOKEN"] = std::nullopt;
  EnvGuard env(vars);
  {
    auto store = std::make_shared<HashStore>();
    ProcessGroup::Options opts;
    opts.timeout = std::chrono::seconds(5);
    // World size 2, but the refusal comes before any peer is needed.
    const std::string msg = tdist::test::expect_throw<InvalidArgument>(
        [&] { create_process_group(store, 0, 2, opts); });
    tdist::test::expect_contains(msg, "the collective mesh");
    tdist::test::expect_contains(msg, lan);
    tdist::test::expect_contains(msg, "without a token");
    tdist::test::expect_contains(msg, "TDIST_ALLOW_NO_TOKEN=1");
    EXPECT_FALSE(store->check({"tdist/pg1/addr/0"})) << "published an address it refused";
  }
  {
    EnvGuard token(tdist::test::EnvVars{{"TDIST_TOKEN", "mesh-token-test"}});
    for (const auto& host : published_hosts(nullptr, 2)) EXPECT_EQ(host, lan) << "with a token";
  }
  EnvGuard allow(tdist::test::EnvVars{{"TDIST_ALLOW_NO_TOKEN", "1"}});
  const LogLevel saved = log_level();
  set_log_level(LogLevel::kWarn);
  ::testing::internal::CaptureStderr();
  for (int round = 0; round < 2; ++round) {
    for (const auto& host : published_hosts(nullptr, 2)) EXPECT_EQ(host, lan) << "allowed";
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  set_log_level(saved);
  tdist::test::expect_contains(log, "WITHOUT A TOKEN");
  EXPECT_EQ(log.find("WITHOUT A TOKEN"), log.rfind("WITHOUT A TOKEN"))
      << "said more than once: " << log;
}

// ---- multi-host children (run by tests/harness/two_hosts.sh on two network namespaces) ----

// TDIST_TEST_INIT=tcp|file picks the init method; each rank checks that it published its own
// host's address, then allreduces across both hosts.
TDIST_TEST_CHILD(multihost_child) {
  const std::string how = env::get("TDIST_TEST_INIT").value_or("");
  const std::string host_a = env::get("TDIST_TEST_HOST_A").value_or("");
  const std::string my_host = env::get("TDIST_TEST_HOST_ADDR").value_or("");
  std::string init;
  if (how == "tcp") {
    init = str("tcp://", host_a, ":29571");
  } else if (how == "file") {
    init = str("file://", env::get("TDIST_TEST_SHARED").value_or("/nonexistent"), "/store");
  } else {
    std::cerr << "TDIST_TEST_INIT must be tcp or file, got '" << how << "'" << std::endl;
    return 2;
  }
  auto rv = rendezvous(init, rank, world_size, std::chrono::seconds(30));
  ProcessGroup::Options opts;
  opts.timeout = std::chrono::seconds(20);
  auto pg = create_process_group(rv.store, rank, world_size, opts);
  const std::string published = host_of(rv.store->get_string(str("tdist/pg1/addr/", rank)));
  at::Tensor t = at::full({1000}, static_cast<float>(rank + 1));
  pg->allreduce(t)->wait();
  pg->barrier()->wait();
  const float want = world_size * (world_size + 1) / 2.0f;
  std::cout << "rank " << rank << " of " << world_size << " via " << init << ": published "
            << published << ", allreduce " << t[0].item<float>() << " (expected " << want << ")"
            << std::endl;
  if (published != my_host) {
    std::cerr << "rank " << rank << " published " << published << ", not its host's address "
              << my_host << std::endl;
    return 1;
  }
  return t.eq(want).all().item<bool>() ? 0 : 1;
}

}  // namespace
}  // namespace tdist::comm
