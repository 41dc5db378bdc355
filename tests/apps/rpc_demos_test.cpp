// The RPC training demos as a user runs them. tdist-rpc-seed: two processes started by hand, and
// under tdist-run; the weight it prints must equal single-process libtorch training of the same
// model on the same data (apps/rpc_demos/seed_model.h) to 1e-6. tdist-rpc-split: three workers
// under tdist-run; the loss falls. tdist-rpc-ps-autograd: a server and three trainers under
// tdist-run; every trainer's loss falls and the server's model classifies held-out samples, and on
// Fashion-MNIST it comes within 5 points of tdist-train's accuracy. tdist-rpc-ddp: two trainers
// (DDP) and an embedding owner under tdist-run; the dense replicas agree after every step, and
// without DDP's allreduce the demo fails.
// tdist-bench rpc --autograd (tdist side only, a few iterations)
// completes and prints a time for both shapes (no timing asserted).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <regex>
#include <thread>

#include "apps/rpc_demos/seed_model.h"
#include "tests/harness/command.h"
#include "tests/harness/net.h"
#include "tests/harness/process.h"

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

// The accuracy the PS demo's server printed; fails the test when absent.
double ps_accuracy(const CommandResult& r, const std::string& tail) {
  std::smatch m;
  std::regex re(R"(ps: test accuracy ([0-9.]+) on )" + tail);
  if (!std::regex_search(r.out, m, re)) {
    ADD_FAILURE() << "no accuracy printed: " << r.describe();
    return -1;
  }
  return std::stod(m[1]);
}

// Three trainers update a 2-hidden-layer MLP concurrently: each trainer's forward and backward
// straddle the others' in-place optimizer steps (the server's forward works on snapshots).
TEST(RpcPsAutogradDemo, ThreeTrainersTrainAnMlpOnSyntheticData) {
  CommandOptions o;
  o.timeout = std::chrono::seconds(150);
  auto r = run_command({TDIST_RUN_BIN,
                        "--nproc-per-node",
                        "4",
                        "--master-port",
                        "0",
                        TDIST_RPC_PS_AUTOGRAD_BIN,
                        "--dataset",
                        "synthetic",
                        "--signal",
                        "0.3",
                        "--train-samples",
                        "3000",
                        "--test-samples",
                        "1000",
                        "--hidden",
                        "64",
                        "--layers",
                        "2",
                        "--steps",
                        "60",
                        "--batch",
                        "16",
                        "--lr",
                        "0.01",
                        "--min-accuracy",
                        "0"},
                       o);
  ASSERT_TRUE(r.exited && r.exit_code == 0) << r.describe();
  for (int t = 1; t <= 3; ++t) {
    std::smatch m;
    std::regex re("trainer" + std::to_string(t) + R"(: loss ([0-9.]+) -> ([0-9.]+) over 60 steps)");
    ASSERT_TRUE(std::regex_search(r.out, m, re)) << r.describe();
    EXPECT_LT(std::stod(m[2]), 0.5 * std::stod(m[1])) << r.out;
  }
  // 10 classes: chance is 0.1.
  EXPECT_GE(ps_accuracy(r, "1000 test samples after 3 trainers x 60 steps of 16"), 0.9) << r.out;
}

// Demo 2 against tdist-train on Debian's Fashion-MNIST: the same MLP, initialised from the same
// seed, trained with the same optimizer (plain SGD) on the same number of samples from the same
// 20000 training images (2 trainers x 300 steps of 32 against tdist-train's 600 steps of 32),
// tested on the same 10000 test images. Seed 1: tdist-train 80.86%; the demo 77.06% to 81.09%
// over 85 runs on the 2-core machine, four of them below 80% (asynchronous SGD: the result
// depends on how the two trainers' steps interleave, and an unlucky last few steps cost 2-4
// points; one of those runs failed the 2-point margin this test first had). Seeds 2 and 3 gave
// differences of 1.7 and 0.5 points. A demo whose updates are wrong or not applied lands far
// lower (untrained: about 10%); one that lost half of them would not (tdist-train after 300
// steps: 78.81%), and the synthetic test above does not catch that either.
TEST(RpcPsAutogradDemo, MatchesTdistTrainOnFashionMnist) {
  struct stat st {};
  if (::stat("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz", &st) != 0) {
    GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed (scripts/setup.sh installs "
                    "it)";
  }
  const std::vector<std::string> same = {"--dataset",
                                         "fashion-mnist",
                                         "--train-samples",
                                         "20000",
                                         "--test-samples",
                                         "10000",
                                         "--hidden",
                                         "128",
                                         "--layers",
                                         "2",
                                         "--lr",
                                         "0.05",
                                         "--momentum",
                                         "0",
                                         "--seed",
                                         "1"};
  CommandOptions o;
  o.timeout = std::chrono::seconds(150);
  std::vector<std::string> ps = {TDIST_RUN_BIN, "--nproc-per-node",
                                 "3",           "--master-port",
                                 "0",           TDIST_RPC_PS_AUTOGRAD_BIN,
                                 "--steps",     "300",
                                 "--batch",     "32"};
  ps.insert(ps.end(), same.begin(), same.end());
  auto r = run_command(ps, o);
  ASSERT_TRUE(r.exited && r.exit_code == 0) << r.describe();
  const double demo = ps_accuracy(r, "10000 test samples after 2 trainers x 300 steps of 32");

  const std::string summary = test::temp_dir() + "/summary.json";
  std::vector<std::string> tt = {
      TDIST_TRAIN_BIN, "--threads",    "1",  "--model",    "mlp",  "--optimizer", "sgd",  "--steps",
      "600",           "--batch-size", "32", "--progress", "none", "--summary",   summary};
  tt.insert(tt.end(), same.begin(), same.end());
  auto t = run_command(tt, o);
  ASSERT_TRUE(t.exited && t.exit_code == 0) << t.describe();
  std::smatch m;
  std::regex re(R"(trained 600 steps, test accuracy ([0-9.]+)%)");
  ASSERT_TRUE(std::regex_search(t.out, m, re)) << t.describe();
  const double reference = std::stod(m[1]) / 100;

  std::printf(
      "Fashion-MNIST, MLP 784-128-128-10, 19200 samples: tdist-train %.4f, "
      "parameter server (2 trainers) %.4f\n",
      reference, demo);
  EXPECT_GE(reference, 0.7) << t.out;
  // The stated margin: within 5 points of tdist-train's accuracy.
  EXPECT_NEAR(demo, reference, 0.05) << r.out << t.out;
}

// Demo 4: two trainers, a dense part under DDP and a remote embedding table, one distributed
// backward and one DistributedOptimizer per step; the dense replicas agree after every step.
TEST(RpcDdpDemo, DenseReplicasAgreeAfterEveryStepAndTheLossFalls) {
  CommandOptions o;
  o.timeout = std::chrono::seconds(150);
  auto r = run_command({TDIST_RUN_BIN, "--nproc-per-node", "3", "--master-port", "0",
                        TDIST_RPC_DDP_BIN, "--steps", "60"},
                       o);
  ASSERT_TRUE(r.exited && r.exit_code == 0) << r.describe();
  for (int t = 1; t <= 2; ++t) {
    std::smatch m;
    std::regex re("trainer" + std::to_string(t) +
                  R"(: loss ([0-9.]+) -> ([0-9.]+) over 60 steps; dense parameters agreed after )"
                  R"(every step \(max difference ([0-9.e+-]+)\))");
    ASSERT_TRUE(std::regex_search(r.out, m, re)) << r.describe();
    EXPECT_LT(std::stod(m[2]), 0.5 * std::stod(m[1])) << r.out;
    EXPECT_LE(std::stod(m[3]), 1e-6) << r.out;
  }
}

// Without DDP's allreduce (every forward under no_sync) each trainer steps its replica with its
// own gradients: the check sees them differ after the first step and the demo fails.
TEST(RpcDdpDemo, WithoutDdpSyncTheCheckFails) {
  CommandOptions o;
  o.timeout = std::chrono::seconds(150);
  auto r = run_command({TDIST_RUN_BIN, "--nproc-per-node", "3", "--master-port", "0",
                        TDIST_RPC_DDP_BIN, "--steps", "20", "--no-ddp-sync"},
                       o);
  ASSERT_TRUE(r.exited) << r.describe();
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_NE(r.err.find("the dense parameters differ across trainers after step 0"),
            std::string::npos)
      << r.describe();
}

TEST(RpcAutogradBench, BriefRunPrintsBothRows) {
  CommandOptions o;
  o.timeout = std::chrono::seconds(120);
  auto r =
      run_command({TDIST_BENCH_BIN, "rpc", "--autograd", "--no-torch", "--rounds", "1", "--iters",
                   "5", "--warmup", "1", "--split-iters", "2", "--split-warmup", "0"},
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
