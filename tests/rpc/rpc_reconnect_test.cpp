// Connecting to a peer: a connect or handshake that fails is retried until the call's deadline;
// only a lost established connection marks a peer as gone (real processes, SIGSTOP/SIGCONT).
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tdist/core/env.h"
#include "tdist/core/tcp_store.h"
#include "tests/harness/process.h"
#include "tests/rpc/rpc_test_util.h"

namespace tdist::rpc::test {
namespace {

// Rank 1 is stopped (SIGSTOP) by the test before rank 0's first call to it, and resumed a few
// handshake timeouts later: rank 0's first connect times out in the handshake (rank 1 accepts
// nothing while stopped), and the call must still succeed once rank 1 runs again.
TDIST_TEST_CHILD(rpc_stopped_peer) {
  torch::set_num_threads(1);
  register_test_functions();
  auto store = std::make_shared<TCPStore>("127.0.0.1", master_port(), false, 60s);
  // rpc_timeout also bounds start() (all workers joining): start together.
  store->set("begin/" + std::to_string(rank), "1");
  store->wait({"begin/0", "begin/1"}, 60s);
  RpcOptions o;
  o.store = store;
  o.rpc_timeout = 2s;  // also each handshake's timeout
  o.shutdown_timeout = 60s;
  auto agent = RpcAgent::start("p" + std::to_string(rank), rank, world_size, o);
  store->set("started/" + std::to_string(rank), "1");
  if (rank == 0) {
    store->wait({"stopped"}, 60s);
    try {
      // Timeout 30 s: the first attempts time out while rank 1 is stopped (about 5 s).
      int64_t v =
          agent->rpc_sync<int64_t>(1, "add", Timeout{Millis(30000)}, int64_t{40}, int64_t{2});
      if (v != 42) return 4;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank 0: the call to a stopped and resumed worker failed: %s\n",
                   e.what());
      return 5;
    }
    // The connection works from now on.
    if (agent->rpc_sync<int64_t>(1, "add", int64_t{1}, int64_t{2}) != 3) return 6;
  }
  agent->shutdown(true);
  return 0;
}

TEST(RpcReconnect, AFirstConnectThatTimesOutIsRetried) {
  TCPStore server("127.0.0.1", 0, true, 60s);
  tdist::test::Processes procs("rpc_stopped_peer", 2,
                               {{"MASTER_PORT", std::to_string(server.port())}});
  server.wait({"started/0", "started/1"}, 60s);
  procs.kill(1, SIGSTOP);
  server.set("stopped", "1");
  std::this_thread::sleep_for(5s);  // two handshake timeouts of rank 0 at least
  procs.kill(1, SIGCONT);
  auto results = procs.wait_all(60s);
  EXPECT_TRUE(results[0].ok()) << results[0].describe() << "\n" << results[0].output;
  EXPECT_TRUE(results[1].ok()) << results[1].describe() << "\n" << results[1].output;
}

// A peer that never answers: calls fail at their own deadline (retries do not outlive it), and
// the agent still talks to the others.
TEST(RpcReconnect, RetriesStopAtTheCallsDeadline) {
  register_test_functions();
  auto store = std::make_shared<HashStore>(30000ms);
  // Rank 1's entry points to a listening socket that never accepts (nobody reads its backlog),
  // so every handshake times out.
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 64), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const uint16_t port = ntohs(addr.sin_port);
  store->set("tdist_rpc/1/worker/1", encode(std::string("silent"), std::string("127.0.0.1"), port));
  RpcOptions o;
  o.store = store;
  o.rpc_timeout = 300ms;
  auto agent = RpcAgent::start("w0", 0, 2, o);
  for (int i = 0; i < 2; ++i) {
    auto f = agent->rpc_async<int64_t>(1, "add", Timeout{Millis(1500)}, int64_t{1}, int64_t{1});
    ASSERT_TRUE(eventually([&] { return f.done(); }, 20s)) << "the call outlived its deadline";
    EXPECT_THROW(f.wait(), Error);
  }
  EXPECT_EQ(agent->rpc_sync<int64_t>(0, "add", int64_t{2}, int64_t{3}), 5);
  agent->shutdown(false);
  ::close(fd);
}

}  // namespace
}  // namespace tdist::rpc::test
