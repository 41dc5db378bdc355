// pp x dp = 2 x 2 (four processes, laid out by comm's DeviceMesh {pp, dp}): each stage's
// data-parallel pair runs DDP over the stage's chunk, armed by the pipeline before the last
// weight pass; after 10 SGD steps every parameter equals single-process training of the whole
// model on the whole batch.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>

#include "tdist/comm/device_mesh.h"
#include "tdist/ddp/distributed_data_parallel.h"
#include "tdist/ddp/reducer.h"
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

int run_pp_dp(const std::shared_ptr<comm::ProcessGroup>& world, ScheduleKind kind) {
  const int rank = world->rank();
  // Note [Device mesh layout]: stage s holds world ranks s * dp .. s * dp + dp - 1; the "pp"
  // group is this rank's pipeline (its rank there is its stage), "dp" its stage's replicas.
  const int replicas = world->size() / kPP;
  comm::DeviceMesh mesh(world, {{"pp", kPP}, {"dp", replicas}});
  const int replica = mesh.coordinate("dp");
  const uint64_t seed = 40 + static_cast<uint64_t>(kind);
  auto model = make_model(kPP, seed);
  auto reference = make_model(kPP, seed);
  PipelineStage stage(model, even_bounds(model->size(), kPP), mesh.group("pp")->rank(), kPP);
  std::vector<std::unique_ptr<ddp::DistributedDataParallel<torch::nn::Sequential>>> ddps;
  for (int c = 0; c < stage.num_chunks(); ++c) {
    ddps.push_back(std::make_unique<ddp::DistributedDataParallel<torch::nn::Sequential>>(
        stage.chunk(c), mesh.group("dp")));
  }
  PipelineOptions o;
  o.schedule = kind;
  o.microbatches = 3;
  o.loss_fn = mse;
  o.before_last_weight_pass = [&](int c, const std::vector<at::Tensor>& roots) {
    ddps[static_cast<size_t>(c)]->reducer().prepare_for_forward();
    ddps[static_cast<size_t>(c)]->reducer().prepare_for_backward(roots);
  };
  Pipeline pipe(stage, mesh.group("pp"), o);
  const int64_t local = 6;
  pipe.setup(torch::zeros({local, kWidth}));
  torch::optim::SGD opt(stage.parameters(), kLr);
  torch::optim::SGD ref_opt(reference->parameters(), kLr);
  torch::manual_seed(seed + 1);
  for (int step = 0; step < kSteps; ++step) {
    auto x = torch::randn({local * replicas, kWidth});
    auto y = torch::randn({local * replicas, kOut});
    opt.zero_grad();
    pipe.step(x.narrow(0, replica * local, local), y.narrow(0, replica * local, local));
    opt.step();
    ref_opt.zero_grad();
    mse(reference->forward(x), y).backward();
    ref_opt.step();
  }
  auto mine = stage.parameters();
  auto theirs = stage_params_of(reference, stage);
  int bad = mine.size() == theirs.size() && !mine.empty() ? 0 : 1;
  for (size_t k = 0; k < mine.size() && k < theirs.size(); ++k) {
    const double d = (mine[k] - theirs[k]).abs().max().item<double>();
    if (d > 1e-5) {
      std::cout << pipeline::to_string(kind) << " rank " << rank << ": parameter " << k
                << " differs by " << d << std::endl;
      ++bad;
    }
  }
  return bad;
}

TDIST_TEST_CHILD(pipeline_pp_dp_child) {
  torch::set_num_threads(1);
  auto world = comm::create_process_group(child_store(), rank, world_size,
                                          group_options(Millis(60000)));
  int bad = run_pp_dp(world, ScheduleKind::k1F1B) + run_pp_dp(world, ScheduleKind::kZeroBubbleH1);
  std::cout << "rank " << rank << ": " << bad << " mismatches" << std::endl;
  return std::min(bad, 100);
}

TEST(PipelineDataParallel, TwoByTwoWithDDPMatchesSingleProcessAfterTenSteps) {
  TCPStoreServer server("127.0.0.1", 0);
  Processes procs("pipeline_pp_dp_child", 4,
                  {{"TDIST_TEST_STORE_PORT", std::to_string(server.port())},
                   {"OMP_NUM_THREADS", "1"}});
  auto results = procs.wait_all(Millis(90000));
  EXPECT_EQ(Processes::failures(results), "");
}

}  // namespace
}  // namespace tdist::test
