// tdist-run --nnodes MIN:MAX (Note [Elastic rendezvous]) as users run it: several launchers on
// loopback, one worker each, acting as nodes; real processes, a real TCPStore, real kills.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "tests/apps/elastic_model.h"
#include "tests/apps/programs.h"
#include "tests/harness/command.h"
#include "tests/harness/expect.h"
#include "tests/harness/net.h"
#include "tests/harness/process.h"

namespace tdist {
namespace {

using test::contains;
using test::kRun;
const std::string kWorker = TDIST_ELASTIC_WORKER_BIN;

// One launcher ("node") running in the background until it exits.
class Node {
 public:
  Node(std::vector<std::string> args, std::map<std::string, std::string> env = {}) {
    args.insert(args.begin(), kRun);
    test::CommandOptions opts;
    opts.timeout = std::chrono::seconds(90);
    opts.env = std::move(env);
    thread_ = std::thread([this, args, opts] { result_ = test::run_command(args, opts); });
  }
  ~Node() {
    if (thread_.joinable()) thread_.join();
  }
  const test::CommandResult& result() {
    if (thread_.joinable()) thread_.join();
    return result_;
  }

 private:
  std::thread thread_;
  test::CommandResult result_;
};

// Blocks until something accepts connections on 127.0.0.1:port (the node serving the store).
bool wait_for_listener(uint16_t port) {
  for (int i = 0; i < 600; ++i) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    ::close(fd);
    if (ok) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

bool wait_for_file(const std::string& path, int seconds) {
  for (int i = 0; i < seconds * 20; ++i) {
    if (::access(path.c_str(), F_OK) == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

std::vector<std::string> elastic_flags(const std::string& nnodes, uint16_t port,
                                       const std::string& id) {
  return {"--nnodes",
          nnodes,
          "--nproc-per-node",
          "1",
          "--rdzv-endpoint",
          "127.0.0.1:" + std::to_string(port),
          "--rdzv-id",
          id,
          "--rdzv-last-call",
          "1",
          "--rdzv-keep-alive-interval",
          "0.2",
          "--rdzv-keep-alive-timeout",
          "2",
          "--stop-grace",
          "2",
          "--rdzv-join-timeout",
          "60"};
}

std::vector<std::string> concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(ElasticRun, AdmitsNodesAndAssignsDenseRanks) {
  const uint16_t port = test::free_port();
  const std::vector<std::string> worker = {
      "sh", "-c",
      "echo vars $RANK $WORLD_SIZE $GROUP_RANK $GROUP_WORLD_SIZE $MASTER_ADDR $MASTER_PORT"};
  Node first(concat(elastic_flags("3:4", port, "dense"), worker));
  ASSERT_TRUE(wait_for_listener(port)) << "the first node never served the rendezvous store";
  Node second(concat(elastic_flags("3:4", port, "dense"), worker));
  Node third(concat(elastic_flags("3:4", port, "dense"), worker));
  std::regex line(R"(\[rank (\d)\] vars (\d) 3 (\d) 3 127\.0\.0\.1 (\d+))");
  std::set<int> ranks;
  std::set<std::string> ports;
  for (Node* n : {&first, &second, &third}) {
    const auto& r = n->result();
    ASSERT_TRUE(r.exited && r.exit_code == 0) << r.describe();
    std::istringstream in(r.out);
    for (std::string l; std::getline(in, l);) {
      std::smatch m;
      if (!std::regex_match(l, m, line)) continue;
      EXPECT_EQ(m[1], m[2]) << l;
      EXPECT_EQ(m[2], m[3]) << "one worker per node: node rank == rank: " << l;
      EXPECT_TRUE(ranks.insert(std::stoi(m[1])).second) << "rank given twice: " << l;
      ports.insert(m[4]);
    }
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2})) << "ranks are dense, one per node";
  EXPECT_EQ(ports.size(), 1u) << "every worker of a round gets the same MASTER_PORT";
  EXPECT_FALSE(ports.count(std::to_string(port))) << "the master port is not the rendezvous port";
}

// The issue's scenario on one host: 3 nodes start, one dies -> the job continues on 2 from the
// checkpoint; a 4th joins -> the next round has 3; the parameters equal those of the same
// world size history computed in this process.
TEST(ElasticRun, ANodeDiesAndANodeJoinsAndTheResultFollowsTheHistory) {
  const uint16_t port = test::free_port();
  const std::string dir = test::temp_dir();
  const std::string schedule = "0:3,30:2,60:3";
  const int64_t total = 90;
  const std::vector<std::string> worker = {
      kWorker,      "--dir",  dir,         "--samples", std::to_string(total),
      "--schedule", schedule, "--step-ms", "20"};
  const auto flags = concat(elastic_flags("2:4", port, "history"), {"--max-restarts", "3"});
  Node a(concat(flags, worker));
  ASSERT_TRUE(wait_for_listener(port)) << "the first node never served the rendezvous store";
  Node b(concat(flags, worker));
  Node c(concat(flags, worker), {{"TDIST_TEST_KILL_LAUNCHER_AT", "30"}});
  // The survivors run samples 30..60 on a world of 2 and hold there: time for a 4th node.
  ASSERT_TRUE(wait_for_file(dir + "/holding_60_2", 80))
      << "the 2-node round never reached 60 samples";
  Node d(concat(flags, worker));

  const auto& rc = c.result();
  EXPECT_EQ(rc.signal, SIGKILL) << rc.describe();
  std::string out, err;
  for (Node* n : {&a, &b, &d}) {
    const auto& r = n->result();
    EXPECT_TRUE(r.exited && r.exit_code == 0) << r.describe();
    out += r.out;
    err += r.err;
  }
  const uint64_t expected = test::elastic_model(test::parse_schedule(schedule), total);
  char hash[32];
  std::snprintf(hash, sizeof(hash), "%016llx", static_cast<unsigned long long>(expected));
  for (int r = 0; r < 3; ++r) {
    const std::string want = "[rank " + std::to_string(r) + "] elastic worker rank " +
                             std::to_string(r) + " of 3: samples 90, params fnv1a64 " + hash;
    EXPECT_TRUE(contains(out, want)) << "missing '" << want << "' in:\n" << out << "\n" << err;
  }
  EXPECT_TRUE(contains(out, "resumes at 30 samples")) << out;
  EXPECT_TRUE(contains(out, "resumes at 60 samples")) << out;
  EXPECT_TRUE(contains(err, "sent no heartbeat"))
      << "the dead node is found by its heartbeats: " << err;
  EXPECT_TRUE(contains(err, "waiting to join")) << err;
  EXPECT_TRUE(contains(err, "of 2 (world size 2)")) << err;
}

TEST(ElasticRun, WorkerFailuresUseUpTheRestartsOnEveryNode) {
  const uint16_t port = test::free_port();
  const auto flags = concat(elastic_flags("2", port, "fail"),
                            {"--rdzv-backend", "c10d", "--max-restarts", "1", "sh", "-c",
                             "echo round $TDIST_RESTART_COUNT; [ $RANK = 1 ] && exit 3; sleep 30"});
  Node a(flags);
  ASSERT_TRUE(wait_for_listener(port));
  Node b(flags);
  for (Node* n : {&a, &b}) {
    const auto& r = n->result();
    EXPECT_TRUE(r.exited && r.exit_code == 1) << r.describe();
    EXPECT_TRUE(contains(r.err, "2 failures exceed --max-restarts 1")) << r.err;
    EXPECT_TRUE(contains(r.out, "round 1")) << "one restart ran: " << r.out;
  }
  EXPECT_TRUE(contains(a.result().err + b.result().err, "exited with code 3"));
}

TEST(ElasticRun, ANodeBeyondMaxWaitsAndLeavesWhenTheJobIsDone) {
  const uint16_t port = test::free_port();
  const std::string dir = test::temp_dir();
  const auto flags =
      concat(elastic_flags("1:1", port, "full"),
             {"sh", "-c", "touch " + dir + "/running; sleep 3; echo done $WORLD_SIZE"});
  Node a(flags);
  ASSERT_TRUE(wait_for_file(dir + "/running", 60));
  Node b(flags);
  EXPECT_TRUE(a.result().exited && a.result().exit_code == 0) << a.result().describe();
  EXPECT_TRUE(contains(a.result().out, "done 1")) << a.result().out;
  const auto& rb = b.result();
  EXPECT_TRUE(rb.exited && rb.exit_code == 0) << rb.describe();
  EXPECT_TRUE(contains(rb.err, "the job finished without this node")) << rb.err;
  EXPECT_FALSE(contains(rb.out, "done")) << "no room: the node ran no worker: " << rb.out;
}

}  // namespace
}  // namespace tdist
