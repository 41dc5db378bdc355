// Hostile peers of the collectives' transport (issue 41 item 4): strangers flooding the mesh's
// port of a rank that is short of file descriptors.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <iostream>
#include <vector>

#include "tdist/comm/ring/ring_process_group.h"
#include "tdist/core/env.h"
#include "tdist/core/tcp_store.h"
#include "tests/comm/comm_test_util.h"
#include "tests/harness/handshake_attacks.h"
#include "tests/harness/proc_counts.h"
#include "tests/harness/process.h"

// A namespace of its own: the tests are compiled as unity batches.
namespace tdist::comm::hostile_peer_test {
namespace {

// ---- item 4: strangers at the mesh of a rank short of descriptors ---------------------------

constexpr int kStrangers = 48;

// Rank 0 lowers its descriptor limit to what it holds now plus a few, then forms a group of 2
// while the test floods its mesh port with strangers; rank 1 joins once rank 0 has taken in the
// whole flood and the test has given rank 0 its limit back ("flooded"). Both check an allreduce.
TDIST_TEST_CHILD(mesh_flood_child) {
  torch::set_num_threads(1);
  auto port = static_cast<uint16_t>(env::require_int("TDIST_TEST_STORE_PORT", 1, 65535));
  auto store = std::make_shared<TCPStore>("127.0.0.1", port, false, Millis(60000));
  auto options = test::test_options(Millis(30000));
  options.token = "s3cret";
  if (rank == 0) {
    rlimit low{};
    ::getrlimit(RLIMIT_NOFILE, &low);
    low.rlim_cur = static_cast<rlim_t>(tdist::test::fd_count() + 16);
    if (::setrlimit(RLIMIT_NOFILE, &low) != 0) return 20;
  } else {
    store->wait({"flooded"}, Millis(60000));
  }
  std::shared_ptr<ProcessGroup> pg;
  try {
    pg = create_process_group(store, rank, world_size, options);
  } catch (const std::exception& e) {
    std::cerr << "rank " << rank << " could not create the group: " << e.what() << std::endl;
    return 21;
  }
  auto x = torch::ones({8});
  pg->allreduce(x)->wait();
  return torch::equal(x, torch::full({8}, 2.0f)) ? 0 : 22;
}

int count_lines(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

TEST(HostilePeer, MeshFormsUnderAStrangerFloodOnARankOutOfDescriptors) {
  TCPStoreServer server("127.0.0.1", 0, "");
  tdist::test::Processes procs("mesh_flood_child", 2,
                               {{"TDIST_TEST_STORE_PORT", std::to_string(server.port())},
                                {"TDIST_LOG_LEVEL", "warn"}});
  TCPStore store("127.0.0.1", server.port(), false, Millis(30000));
  store.wait({"tdist/pg1/addr/0"}, Millis(30000));
  const std::string addr = store.get_string("tdist/pg1/addr/0");
  const auto colon = addr.rfind(':');
  tdist::test::HandshakePort port{addr.substr(0, colon),
                                  static_cast<uint16_t>(std::stoi(addr.substr(colon + 1))),
                                  net::Service::kMesh, 13};
  // Strangers that connect and say nothing: far more than rank 0 has descriptors for.
  std::vector<int> strangers;
  for (int i = 0; i < kStrangers; ++i) {
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(port.port);
    ::inet_pton(AF_INET, port.host.c_str(), &sa.sin_addr);
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));  // completes in the background
    strangers.push_back(fd);
  }
  // Rank 0 has taken in every stranger once each one got its challenge or was closed.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (int fd : strangers) {
    pollfd p{fd, POLLIN, 0};
    while (::poll(&p, 1, 100) == 0 && std::chrono::steady_clock::now() < until) {
    }
  }
  rlimit limit{};
  ::getrlimit(RLIMIT_NOFILE, &limit);
  ::prlimit(procs.pid(0), RLIMIT_NOFILE, &limit, nullptr);  // fails harmlessly if rank 0 died
  store.set("flooded", "1");
  const auto results = procs.wait_all(Millis(60000));
  for (int fd : strangers) ::close(fd);
  ASSERT_EQ(tdist::test::Processes::failures(results), "");
  // Rank 0 ran out of descriptors and dropped strangers for them, and did not log every
  // refusal: the warnings are rate-limited.
  EXPECT_NE(results[0].output.find("out of file descriptors"), std::string::npos)
      << results[0].output;
  EXPECT_LE(count_lines(results[0].output, "[warning]"), 15) << results[0].output;
}

}  // namespace
}  // namespace tdist::comm::hostile_peer_test
