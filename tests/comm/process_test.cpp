// Real processes: the collectives across 2 and 4 processes (TCPStore; one case through the
// env:// init_method), and a process killed in the middle of an allreduce loop.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <iostream>
#include <thread>

#include "tdist/core/env.h"
#include "tdist/core/tcp_store.h"
#include "tests/comm/comm_test_util.h"
#include "tests/harness/process.h"
#include "tests/harness/net.h"

namespace tdist::comm {
namespace {

using ::tdist::test::free_port;

std::shared_ptr<Store> child_store() {
  auto port = static_cast<uint16_t>(env::require_int("TDIST_TEST_STORE_PORT", 1, 65535));
  return std::make_shared<TCPStore>("127.0.0.1", port, false, Millis(60000));
}

// Returns the number of mismatches (printed).
int run_collectives(ProcessGroup& pg) {
  const int rank = pg.rank();
  const int world = pg.size();
  int bad = 0;
  auto expect = [&](bool ok, const char* what) {
    if (!ok) {
      std::cerr << "rank " << rank << ": wrong result of " << what << std::endl;
      ++bad;
    }
  };
  for (int64_t n : {1, 1000, 300000}) {
    auto x = torch::full({n}, double(rank + 1));
    pg.allreduce(x)->wait();
    expect(torch::equal(x, torch::full({n}, world * (world + 1) / 2.0)), "allreduce");
  }
  auto b = rank == 1 ? torch::arange(5000, torch::kLong) : torch::zeros({5000}, torch::kLong);
  BroadcastOptions bo;
  bo.root = 1;
  pg.broadcast(b, bo)->wait();
  expect(torch::equal(b, torch::arange(5000, torch::kLong)), "broadcast");
  auto in = torch::full({3}, double(rank));
  auto flat = torch::empty({3 * world});
  pg.allgather_into_tensor(flat, in)->wait();
  for (int r = 0; r < world; ++r) expect(torch::equal(flat.narrow(0, 3 * r, 3), torch::full({3}, double(r))), "allgather");
  auto rs_in = torch::arange(world * 4, torch::kFloat);
  auto rs_out = torch::empty({4});
  pg.reduce_scatter_tensor(rs_out, rs_in)->wait();
  expect(torch::equal(rs_out, torch::arange(rank * 4, rank * 4 + 4, torch::kFloat) * world), "reduce_scatter");
  auto a_in = torch::full({world}, double(rank));
  auto a_out = torch::empty({world});
  pg.alltoall_base(a_out, a_in, {}, {})->wait();
  expect(torch::equal(a_out, torch::arange(world, torch::kFloat)), "alltoall");
  pg.barrier()->wait();
  if (rank == 0) {
    for (int r = 1; r < world; ++r) pg.send(torch::full({2}, double(r)), r, 3)->wait();
  } else {
    auto t = torch::empty({2});
    pg.recv(t, 0, 3)->wait();
    expect(torch::equal(t, torch::full({2}, double(rank))), "send/recv");
  }
  pg.barrier()->wait();
  return bad;
}

TDIST_TEST_CHILD(comm_collectives_child) {
  torch::set_num_threads(1);
  auto pg = create_process_group(child_store(), rank, world_size, test::test_options());
  return run_collectives(*pg);
}

TDIST_TEST_CHILD(comm_env_init_child) {
  torch::set_num_threads(1);
  auto pg = create_process_group("env://", -1, -1, test::test_options());
  return pg->rank() == rank && pg->size() == world_size ? run_collectives(*pg) : 20;
}

// Allreduces of 1 MiB in a loop until one fails; exits 0 when the failure names this rank, the
// operation, its sequence number and a peer.
TDIST_TEST_CHILD(comm_killed_peer_child) {
  torch::set_num_threads(1);
  auto store = child_store();
  auto pg = create_process_group(store, rank, world_size, test::test_options(Millis(20000)));
  auto x = torch::ones({1 << 18});
  for (int i = 0;; ++i) {
    try {
      pg->allreduce(x)->wait();
    } catch (const std::exception& e) {
      std::string msg = e.what();
      std::cerr << "rank " << rank << " failed at iteration " << i << ": " << msg << std::endl;
      bool named = msg.find(str("rank ", rank, ": allreduce (seq ")) != std::string::npos &&
                   (msg.find("lost rank") != std::string::npos ||
                    msg.find("waiting for rank") != std::string::npos);
      // Later operations fail at once.
      bool aborted = pg->barrier()->is_completed();
      return named && aborted ? 0 : 11;
    }
    store->add(str("progress/", rank), 1);
  }
}

class ProcessTest : public ::testing::TestWithParam<int> {};

TEST_P(ProcessTest, CollectivesOverTCPStore) {
  TCPStoreServer server("127.0.0.1", 0);
  tdist::test::Processes procs("comm_collectives_child", GetParam(),
                               {{"TDIST_TEST_STORE_PORT", std::to_string(server.port())}});
  auto results = procs.wait_all(Millis(90000));
  EXPECT_EQ(tdist::test::Processes::failures(results), "");
}


// env://: rank 0's process hosts the TCPStore on MASTER_PORT.
TEST(ProcessTest, EnvInitMethod) {
  tdist::test::Processes procs("comm_env_init_child", 2,
                               {{"MASTER_ADDR", "127.0.0.1"},
                                {"MASTER_PORT", std::to_string(free_port())}});
  auto results = procs.wait_all(Millis(90000));
  EXPECT_EQ(tdist::test::Processes::failures(results), "");
}

INSTANTIATE_TEST_SUITE_P(Worlds, ProcessTest, ::testing::Values(2, 4));

// Both transports: over TCP the survivors see the socket break; over shared memory they see
// the doorbell socket's end-of-file once the ring runs dry.
class ProcessFailure : public ::testing::TestWithParam<const char*> {};

TEST_P(ProcessFailure, KilledProcessMidAllreduceFailsTheOthers) {
  const int world = 3;
  TCPStoreServer server("127.0.0.1", 0);
  TCPStore store("127.0.0.1", server.port(), false, Millis(60000));
  tdist::test::Processes procs("comm_killed_peer_child", world,
                               {{"TDIST_TEST_STORE_PORT", std::to_string(server.port())},
                                {"TDIST_TRANSPORT", GetParam()}});
  // Let every rank finish a few allreduces, then kill rank 1 while they keep going.
  for (int r = 0; r < world; ++r) store.wait({str("progress/", r)}, Millis(60000));
  procs.kill(1, SIGKILL);
  auto results = procs.wait_all(Millis(60000));
  EXPECT_FALSE(results[1].exited);
  EXPECT_EQ(results[1].signal, SIGKILL);
  for (int r : {0, 2}) {
    EXPECT_TRUE(results[r].ok()) << results[r].describe() << "\n" << results[r].output;
    EXPECT_FALSE(results[r].timed_out);
    std::cout << results[r].output;
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, ProcessFailure, ::testing::Values("auto", "tcp"));

}  // namespace
}  // namespace tdist::comm
