// TDIST_TRACE: each rank writes a Chrome-trace JSON of forward, backward, bucket communication
// and the final wait.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "tdist/core/error.h"
#include "tdist/ddp/trace.h"
#include "tests/ddp/ddp_test_util.h"
#include "tests/harness/env_guard.h"
#include "tests/harness/process.h"

namespace tdist::test {
namespace {

TEST(DDPTrace, PathPerRank) {
  EXPECT_EQ(ddp::Trace::path_for_rank("/tmp/t.json", 3), "/tmp/t.rank3.json");
  EXPECT_EQ(ddp::Trace::path_for_rank("/tmp/t-{rank}.trace", 1), "/tmp/t-1.trace");
  EXPECT_EQ(ddp::Trace::path_for_rank("/tmp/dir.d/trace", 0), "/tmp/dir.d/trace.rank0");
  EXPECT_EQ(ddp::Trace::path_for_rank("trace", 2), "trace.rank2");
}

TEST(DDPTrace, EveryRankWritesForwardBackwardBucketsAndWait) {
  torch::set_num_threads(1);
  const std::string dir = temp_dir("tdist-ddp-trace");
  EnvGuard env({{"TDIST_TRACE", dir + "/ddp.json"}});
  const int world = 2, iterations = 2;
  run_ranks(world, [&](int rank, std::shared_ptr<comm::ProcessGroup> pg) {
    MLP net;
    ddp::DDPOptions opts;
    opts.bucket_cap_mb = 1e-6;  // 6 buckets
    ddp::DistributedDataParallel<MLP> model(net, pg, opts);
    for (int i = 0; i < iterations; ++i) {
      torch::mse_loss(model(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
    }
    {
      auto guard = model.no_sync();
      torch::mse_loss(model(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
    }
    (void)rank;
  });  // the DDP objects are gone: the files are written
  for (int r = 0; r < world; ++r) {
    const std::string path = dir + "/ddp.rank" + std::to_string(r) + ".json";
    std::ifstream f(path);
    ASSERT_TRUE(f.good()) << path;
    nlohmann::json trace = nlohmann::json::parse(f);  // throws on malformed JSON
    std::map<std::string, int> count;
    int64_t first_comm_begin = INT64_MAX, first_backward_end = INT64_MAX;
    for (const auto& e : trace["traceEvents"]) {
      if (e["ph"] != "X") continue;
      EXPECT_EQ(e["pid"], r);
      std::string name = e["name"];
      ++count[name.rfind("comm bucket", 0) == 0 ? "comm" : name];
      EXPECT_GE(e["dur"].get<int64_t>(), 0);
      if (name.rfind("comm bucket", 0) == 0) {
        EXPECT_EQ(e["tid"], 1);
        first_comm_begin = std::min(first_comm_begin, e["ts"].get<int64_t>());
      }
      if (name == "backward") {
        first_backward_end =
            std::min(first_backward_end, e["ts"].get<int64_t>() + e["dur"].get<int64_t>());
      }
    }
    EXPECT_EQ(count["forward"], iterations) << path;
    EXPECT_EQ(count["forward (no sync)"], 1) << path;
    EXPECT_EQ(count["backward"], iterations) << path;
    EXPECT_EQ(count["final wait"], iterations) << path;
    EXPECT_EQ(count["comm"], iterations * 6) << path;
    // The overlap is visible: the first bucket went out before the first backward ended.
    EXPECT_LT(first_comm_begin, first_backward_end) << path;
  }
  std::filesystem::remove_all(dir);
}

TEST(DDPTrace, UnwritablePathIsReportedByFlush) {
  // A path below a regular file: no directory can be made there, not even by root (the writer
  // creates missing directories, so a missing one is not unwritable).
  const auto file = std::filesystem::temp_directory_path() /
                    ("tdist-trace-not-a-dir-" + std::to_string(::getpid()));
  std::ofstream(file) << "x";
  ddp::Trace t((file / "x" / "trace.json").string(), 0);
  t.add("forward", ddp::Trace::Track::kCompute, 0, 1);
  EXPECT_THROW(t.flush(), Error);
  std::filesystem::remove(file);
}

}  // namespace
}  // namespace tdist::test
