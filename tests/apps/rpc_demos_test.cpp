// The RPC training demos as a user runs them. tdist-rpc-seed: two processes started by hand, and
// under tdist-run; the weight it prints must equal single-process libtorch training of the same
// model on the same data (apps/rpc_demos/seed_model.h) to 1e-6. tdist-rpc-split: three workers
// under tdist-run; the loss falls. tdist-rpc-ps-autograd: a server and three trainers under
// tdist-run; every trainer's loss falls and the server's model classifies held-out samples.
// tdist-bench rpc --autograd (tdist side only, a few iterations)
// completes and prints a time for both shapes (no timing asserted).
#include <gtest/gtest.h>

#include <regex>
#include <thread>

#include "apps/rpc_demos/seed_model.h"
#include "tests/harness/command.h"
#include "tests/harness/net.h"

namespace tdist {
namespace {

using test::CommandOptions;
using test::CommandResult;
using test::run_command;

// The two numbers of "trained weight: a b" in `out`; fails the test when absent.
std::vector<double> printed_weight(const std::string& out) {
  std::smatch m;
  std::regex re(R"(trained weight: (-?[0-9.]+) (-?[0-9.]+))");
  if (!std::regex_search(out, m, re)) {
    ADD_FAILURE() << "no weight printed in: " << out;
    return {};
  }
  return {std::stod(m[1]), std::stod(m[2])};
}

void expect_matches_local_training(const std::string& out) {
  auto w = printed_weight(out);
  ASSERT_EQ(w.size(), 2u);
  at::Tensor ref = demo::seed::train_locally(demo::seed::kDefaultSteps, demo::seed::kDefaultLr);
  EXPECT_NEAR(w[0], ref[0][0].item<double>(), 1e-6);
  EXPECT_NEAR(w[1], ref[0][1].item<double>(), 1e-6);
  // It trained: the weight moved from its start towards (1.5, -0.5).
  EXPECT_GT(std::abs(w[0] - demo::seed::initial_weight()[0]), 0.1);
}

TEST(RpcSeedDemo, TwoProcessesStartedByHand) {
  CommandOptions o;
  o.timeout = std::chrono::seconds(90);
  o.env = {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(test::free_port())}};
  CommandResult b;
  std::thread node_b([&] {
    b = run_command({TDIST_RPC_SEED_BIN, "--rank", "1", "--world-size", "2"}, o);
  });
  CommandResult a = run_command({TDIST_RPC_SEED_BIN, "--rank", "0", "--world-size", "2"}, o);
  node_b.join();
  ASSERT_TRUE(a.exited && a.exit_code == 0) << a.describe();
  ASSERT_TRUE(b.exited && b.exit_code == 0) << b.describe();
  expect_matches_local_training(a.out);
  EXPECT_EQ(b.out.find("trained weight"), std::string::npos) << "node B only serves";
}

TEST(RpcSeedDemo, UnderTdistRun) {
  CommandOptions o;
  o.timeout = std::chrono::seconds(90);
  auto r = run_command(
      {TDIST_RUN_BIN, "--nproc-per-node", "2", "--master-port", "0", TDIST_RPC_SEED_BIN}, o);
  ASSERT_TRUE(r.exited && r.exit_code == 0) << r.describe();
  EXPECT_NE(r.out.find("[rank 0] trained weight"), std::string::npos) << r.describe();
  expect_matches_local_training(r.out);
}

TEST(RpcSeedDemo, RefusesAWrongWorldSize) {
  CommandOptions o;
  o.timeout = std::chrono::seconds(30);
  o.env = {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(test::free_port())}};
  auto r = run_command({TDIST_RPC_SEED_BIN, "--rank", "0", "--world-size", "3"}, o);
  EXPECT_TRUE(r.exited && r.exit_code == 1) << r.describe();
  EXPECT_NE(r.err.find("exactly 2 workers"), std::string::npos) << r.describe();
}

TEST(RpcSplitDemo, LossFallsAcrossThreeWorkers) {
  CommandOptions o;
  o.timeout = std::chrono::seconds(150);
  auto r = run_command({TDIST_RUN_BIN, "--nproc-per-node", "3", "--master-port", "0",
                        TDIST_RPC_SPLIT_BIN, "--steps", "60"},
                       o);
  ASSERT_TRUE(r.exited && r.exit_code == 0) << r.describe();
  std::smatch m;
  std::regex re(R"(loss ([0-9.]+) -> ([0-9.]+) over 60 steps)");
  ASSERT_TRUE(std::regex_search(r.out, m, re)) << r.describe();
  EXPECT_LT(std::stod(m[2]), 0.5 * std::stod(m[1])) << r.out;
}

TEST(RpcPsAutogradDemo, ThreeTrainersReachHighAccuracy) {
  CommandOptions o;
  o.timeout = std::chrono::seconds(150);
  auto r = run_command({TDIST_RUN_BIN, "--nproc-per-node", "4", "--master-port", "0",
                        TDIST_RPC_PS_AUTOGRAD_BIN, "--steps", "100", "--min-accuracy", "0"},
                       o);
  ASSERT_TRUE(r.exited && r.exit_code == 0) << r.describe();
  for (int t = 1; t <= 3; ++t) {
    std::smatch m;
    std::regex re("trainer" + std::to_string(t) + R"(: loss ([0-9.]+) -> ([0-9.]+) over 100 steps)");
    ASSERT_TRUE(std::regex_search(r.out, m, re)) << r.describe();
    EXPECT_LT(std::stod(m[2]), 0.5 * std::stod(m[1])) << r.out;
  }
  std::smatch m;
  std::regex re(R"(ps: accuracy ([0-9.]+) on 2000 held-out samples after 3 trainers)");
  ASSERT_TRUE(std::regex_search(r.out, m, re)) << r.describe();
  // 4 classes: chance is 0.25; the clusters are separable enough for a linear model.
  EXPECT_GE(std::stod(m[1]), 0.9) << r.out;
}

TEST(RpcAutogradBench, BriefRunPrintsBothRows) {
  CommandOptions o;
  o.timeout = std::chrono::seconds(120);
  auto r = run_command({TDIST_BENCH_BIN, "rpc", "--autograd", "--no-torch", "--rounds", "1",
                        "--iters", "5", "--warmup", "1", "--split-iters", "2", "--split-warmup",
                        "0"},
                       o);
  ASSERT_TRUE(r.exited && r.exit_code == 0) << r.describe();
  for (const char* row : {R"(seed: Linear 2->1 [^\n]*SGD +([0-9.]+))",
                          R"(split MLP 784-1024x3-10[^\n]*SGD +([0-9.]+))"}) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.out, m, std::regex(row))) << row << " in " << r.out;
    EXPECT_GT(std::stod(m[1]), 0.0) << r.out;
  }
}

}  // namespace
}  // namespace tdist
