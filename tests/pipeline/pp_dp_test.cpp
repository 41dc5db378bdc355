// pp x dp = 2 x 2 (four processes, laid out by comm's DeviceMesh {pp, dp}): each stage's
// data-parallel pair runs DDP over the stage's chunk, armed by the pipeline before the last
// weight pass, or shards the chunk's parameters across the pair (fsdp's ParamGroup: gathered
// once before the step, the gradients of every microbatch reduce-scattered once after it);
// after 10 SGD steps every parameter equals single-process training of the whole model on the
// whole batch.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <signal.h>

#include <iostream>

#include "tdist/comm/device_mesh.h"
#include "tdist/ddp/distributed_data_parallel.h"
#include "tdist/ddp/reducer.h"
#include "tdist/fsdp/detail/param_group.h"
#include "tests/harness/process.h"
#include "tests/pipeline/pipeline_test_util.h"

namespace tdist::test {
namespace {

using pipeline::Pipeline;
using pipeline::PipelineOptions;
using pipeline::PipelineStage;
using pipeline::ScheduleKind;

constexpr int kPP = 2;
constexpr int kSteps = 10;
constexpr double kLr = 0.05;

enum class DataParallel { kDDP, kFSDP };

// >= 0: world rank 1 kills itself (SIGKILL) after the pipeline step of this step, before its
// stage's reduce-scatter.
int g_kill_at_step = -1;

int run_pp_dp(const std::shared_ptr<comm::ProcessGroup>& world, ScheduleKind kind,
              DataParallel dp) {
  const int rank = world->rank();
  // Note [Device mesh layout]: stage s holds world ranks s * dp .. s * dp + dp - 1; the "pp"
  // group is this rank's pipeline (its rank there is its stage), "dp" its stage's replicas.
  const int replicas = world->size() / kPP;
  comm::DeviceMesh mesh(world, {{"pp", kPP}, {"dp", replicas}});
  const int replica = mesh.coordinate("dp");
  const uint64_t seed = 40 + static_cast<uint64_t>(kind);
  auto model = make_model(kPP, seed);
  auto reference = make_model(kPP, seed);
  const int parts = kind == ScheduleKind::kInterleaved1F1B ? 2 * kPP : kPP;
  PipelineStage stage(model, even_bounds(model->size(), parts), mesh.group("pp")->rank(), kPP);
  std::vector<std::unique_ptr<ddp::DistributedDataParallel<torch::nn::Sequential>>> ddps;
  std::vector<std::unique_ptr<fsdp::detail::ParamGroup>> shards;  // one per chunk
  std::vector<at::Tensor> optimized;
  for (int c = 0; c < stage.num_chunks(); ++c) {
    if (dp == DataParallel::kDDP) {
      ddps.push_back(std::make_unique<ddp::DistributedDataParallel<torch::nn::Sequential>>(
          stage.chunk(c), mesh.group("dp")));
      continue;
    }
    std::vector<std::string> names;
    for (const auto& item : stage.chunk(c)->named_parameters()) names.push_back(item.key());
    fsdp::detail::ShardingConfig sc;
    sc.shard_pg = mesh.group("dp");
    shards.push_back(std::make_unique<fsdp::detail::ParamGroup>(
        "chunk " + std::to_string(c), stage.chunk(c)->parameters(), names, sc));
    optimized.push_back(shards.back()->sharded_param());
  }
  if (dp == DataParallel::kDDP) optimized = stage.parameters();
  PipelineOptions o;
  o.schedule = kind;
  o.microbatches = 3;
  o.loss_fn = mse;
  if (dp == DataParallel::kDDP) {
    o.before_last_weight_pass = [&](int c, const std::vector<at::Tensor>& roots) {
      ddps[static_cast<size_t>(c)]->reducer().prepare_for_forward();
      ddps[static_cast<size_t>(c)]->reducer().prepare_for_backward(roots);
    };
  }
  Pipeline pipe(stage, mesh.group("pp"), o);
  const int64_t local = 6;
  for (auto& g : shards) g->unshard();
  pipe.setup(torch::zeros({local, kWidth}));
  for (auto& g : shards) g->reshard();
  torch::optim::SGD opt(optimized, kLr);
  torch::optim::SGD ref_opt(reference->parameters(), kLr);
  torch::manual_seed(seed + 1);
  for (int step = 0; step < kSteps; ++step) {
    auto x = torch::randn({local * replicas, kWidth});
    auto y = torch::randn({local * replicas, kOut});
    opt.zero_grad();
    for (auto& g : shards) g->unshard();  // once per step, for every microbatch
    pipe.step(x.narrow(0, replica * local, local), y.narrow(0, replica * local, local));
    if (step == g_kill_at_step && rank == 1) ::raise(SIGKILL);
    for (auto& g : shards) g->reduce_grads();  // the sum over the microbatches, averaged
    for (auto& g : shards) {
      g->reshard();
      g->finish_reduce();
    }
    opt.step();
    ref_opt.zero_grad();
    mse(reference->forward(x), y).backward();
    ref_opt.step();
  }
  std::vector<at::Tensor> mine = stage.parameters();
  if (dp == DataParallel::kFSDP) {
    mine.clear();
    for (auto& g : shards) {
      for (auto& t : g->gather_full()) mine.push_back(t);  // a collective over the pair
    }
  }
  auto theirs = stage_params_of(reference, stage);
  int bad = mine.size() == theirs.size() && !mine.empty() ? 0 : 1;
  for (size_t k = 0; k < mine.size() && k < theirs.size(); ++k) {
    const double d = (mine[k] - theirs[k]).abs().max().item<double>();
    if (d > 1e-5) {
      std::cout << pipeline::to_string(kind) << (dp == DataParallel::kDDP ? " ddp" : " fsdp")
                << " rank " << rank << ": parameter " << k << " differs by " << d << std::endl;
      ++bad;
    }
  }
  return bad;
}

TDIST_TEST_CHILD(pipeline_pp_dp_child) {
  torch::set_num_threads(1);
  auto world =
      comm::create_process_group(child_store(), rank, world_size, group_options(Millis(60000)));
  int bad = run_pp_dp(world, ScheduleKind::k1F1B, DataParallel::kDDP) +
            run_pp_dp(world, ScheduleKind::kZeroBubbleH1, DataParallel::kDDP);
  std::cout << "rank " << rank << ": " << bad << " mismatches" << std::endl;
  return std::min(bad, 100);
}

TDIST_TEST_CHILD(pipeline_pp_fsdp_child) {
  torch::set_num_threads(1);
  auto world =
      comm::create_process_group(child_store(), rank, world_size, group_options(Millis(60000)));
  int bad = run_pp_dp(world, ScheduleKind::k1F1B, DataParallel::kFSDP) +
            run_pp_dp(world, ScheduleKind::kInterleaved1F1B, DataParallel::kFSDP) +
            run_pp_dp(world, ScheduleKind::kZeroBubbleH1, DataParallel::kFSDP);
  std::cout << "rank " << rank << ": " << bad << " mismatches" << std::endl;
  return std::min(bad, 100);
}

TDIST_TEST_CHILD(pipeline_pp_fsdp_killed_child) {
  torch::set_num_threads(1);
  auto world =
      comm::create_process_group(child_store(), rank, world_size, group_options(Millis(10000)));
  g_kill_at_step = 2;
  try {
    run_pp_dp(world, ScheduleKind::k1F1B, DataParallel::kFSDP);
  } catch (const std::exception& e) {
    std::cout << "PP ERROR: " << e.what() << std::endl;
    return 3;
  }
  return 0;
}

void run_four(const std::string& child) {
  TCPStoreServer server("127.0.0.1", 0);
  Processes procs(
      child, 4,
      {{"TDIST_TEST_STORE_PORT", std::to_string(server.port())}, {"OMP_NUM_THREADS", "1"}});
  auto results = procs.wait_all(Millis(90000));
  EXPECT_EQ(Processes::failures(results), "");
}

TEST(PipelineDataParallel, TwoByTwoWithDDPMatchesSingleProcessAfterTenSteps) {
  run_four("pipeline_pp_dp_child");
}

TEST(PipelineDataParallel, TwoByTwoWithShardedStagesMatchesSingleProcessAfterTenSteps) {
  run_four("pipeline_pp_fsdp_child");
}

// A replica killed between its pipeline step and its stage's reduce-scatter: its partner fails
// in the reduce-scatter, naming it, and its Pipeline, destroyed as that error unwinds, tells
// the other stage; that stage's ranks fail in their next pipeline step, rank 2 by that notice
// (before it, it waited out its timeout for an activation that never came) and rank 3 by its
// lost neighbour. None hangs.
TEST(PipelineDataParallel, AShardedReplicaKilledBeforeItsReduceScatterFailsEveryOtherRank) {
  TCPStoreServer server("127.0.0.1", 0);
  Processes procs(
      "pipeline_pp_fsdp_killed_child", 4,
      {{"TDIST_TEST_STORE_PORT", std::to_string(server.port())}, {"OMP_NUM_THREADS", "1"}});
  auto results = procs.wait_all(Millis(60000));
  ASSERT_EQ(results.size(), 4u);
  EXPECT_FALSE(results[1].exited) << results[1].describe() << "\n" << results[1].output;
  EXPECT_EQ(results[1].signal, SIGKILL) << results[1].describe();
  for (int r : {0, 2, 3}) {
    EXPECT_FALSE(results[r].timed_out) << "rank " << r << " hung:\n" << results[r].output;
    EXPECT_TRUE(results[r].exited && results[r].exit_code == 3) << results[r].describe() << "\n"
                                                                << results[r].output;
    EXPECT_NE(results[r].output.find("PP ERROR"), std::string::npos) << results[r].output;
  }
  EXPECT_NE(results[0].output.find("PP ERROR: rank 0: reduce_scatter_tensor"), std::string::npos)
      << results[0].output;
  EXPECT_NE(results[0].output.find("lost rank 1"), std::string::npos) << results[0].output;
  EXPECT_NE(results[2].output.find("left the pipeline: an error outside the pipeline stopped its "
                                   "caller"),
            std::string::npos)
      << results[2].output;
  EXPECT_EQ(results[2].output.find("timed out"), std::string::npos) << results[2].output;
  for (int r : {0, 2, 3}) std::cout << "rank " << r << "'s output:\n" << results[r].output;
}

}  // namespace
}  // namespace tdist::test
