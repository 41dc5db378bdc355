// Set-up errors and a stage killed mid-step, with ranks as real processes: clear errors on every
// rank (naming the stages), never a hang.
#include <signal.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <iostream>

#include "tests/harness/process.h"
#include "tests/pipeline/pipeline_test_util.h"

namespace tdist::test {
namespace {

using pipeline::Pipeline;
using pipeline::PipelineOptions;
using pipeline::PipelineStage;
using pipeline::ScheduleKind;

PipelineOptions options(ScheduleKind kind, int m) {
  PipelineOptions o;
  o.schedule = kind;
  o.microbatches = m;
  o.loss_fn = mse;
  return o;
}

// Prints "<label>: <error>" and returns whether it threw E containing every one of `parts`.
template <typename E = InvalidArgument, typename Fn>
bool expect_invalid(const std::string& label, Fn fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const E& e) {
    std::cout << label << ": " << e.what() << std::endl;
    for (const auto& part : parts) {
      if (std::string(e.what()).find(part) == std::string::npos) {
        std::cout << label << ": missing '" << part << "'" << std::endl;
        return false;
      }
    }
    return true;
  } catch (const std::exception& e) {
    std::cout << label << ": another error type: " << e.what() << std::endl;
    return false;
  }
  std::cout << label << ": no error" << std::endl;
  return false;
}

// Three stages: m not dividing the batch, then stage 1 expecting 5 features where stage 0 makes
// 6; after both failed set-ups a correct pipeline still trains on the same group.
TDIST_TEST_CHILD(pipeline_setup_errors_child) {
  torch::set_num_threads(1);
  auto pg =
      comm::create_process_group(child_store(), rank, world_size, group_options(Millis(30000)));
  int bad = 0;
  {
    auto model = make_model(world_size, 1);
    Pipeline pipe(PipelineStage(model, even_bounds(model->size(), world_size), rank, world_size),
                  pg, options(ScheduleKind::k1F1B, 4));
    bad += !expect_invalid("microbatches",
                           [&] {
                             pipe.setup(torch::zeros({6, kWidth}));
                           },
                           {"batch of 6", "4 equal microbatches"});
    bad += !expect_invalid("step before set-up", [&] { pipe.step(at::Tensor(), at::Tensor()); },
                           {"setup()"});
    bad += !expect_invalid("eval before set-up", [&] { pipe.eval(at::Tensor()); },
                           {"setup() before eval()"});
  }
  {
    torch::manual_seed(2);
    torch::nn::Sequential model(torch::nn::Linear(kWidth, kWidth), torch::nn::Tanh(),
                                torch::nn::Linear(kWidth - 1, kOut), torch::nn::Tanh(),
                                torch::nn::Linear(kOut, kOut), torch::nn::Tanh());
    Pipeline pipe(PipelineStage(model, {0, 2, 4, 6}, rank, world_size), pg,
                  options(ScheduleKind::kGPipe, 2));
    bad += !expect_invalid("shapes",
                           [&] {
                             pipe.setup(torch::zeros({4, kWidth}));
                           },
                           {"stage 1 (rank 1, layers [2, 4))", "stage 0 (rank 0, layers [0, 2))"});
  }
  {
    auto model = make_model(world_size, 3);
    Pipeline pipe(PipelineStage(model, even_bounds(model->size(), world_size), rank, world_size),
                  pg, options(ScheduleKind::kZeroBubbleH1, 2));
    pipe.setup(torch::zeros({4, kWidth}));
    auto loss = pipe.step(torch::randn({4, kWidth}), torch::randn({4, kOut}));
    if (rank == world_size - 1 && !(loss.defined() && std::isfinite(loss.item<double>()))) ++bad;
    pg->barrier()->wait();  // every rank is done with that step before rank 0 fails the next
    // Rank 0 gets a batch of the wrong shape: it fails, and tells the others why.
    bad += !expect_invalid<Error>(
        "inputs",
        [&] {
          pipe.step(torch::randn({rank == 0 ? 5 : 4, kWidth}), torch::randn({4, kOut}));
        },
        {"stage 0 (rank 0", "the first stage's inputs must be shaped"});
  }
  {
    // The same in eval: rank 0's batch has the wrong shape; every rank fails naming it.
    auto model = make_model(world_size, 4);
    Pipeline pipe(PipelineStage(model, even_bounds(model->size(), world_size), rank, world_size),
                  pg, options(ScheduleKind::k1F1B, 2));
    pipe.setup(torch::zeros({4, kWidth}));
    bad += !expect_invalid<Error>(
        "eval inputs",
        [&] {
          pipe.eval(torch::randn({rank == 0 ? 3 : 4, kWidth}));
        },
        {"pipeline eval", "stage 0 (rank 0", "the first stage's inputs must be shaped"});
  }
  std::cout << "rank " << rank << ": " << bad << " unexpected" << std::endl;
  return bad;
}

TEST(PipelineErrors, SetUpErrorsAreClearOnEveryRank) {
  TCPStoreServer server("127.0.0.1", 0);
  Processes procs(
      "pipeline_setup_errors_child", 3,
      {{"TDIST_TEST_STORE_PORT", std::to_string(server.port())}, {"OMP_NUM_THREADS", "1"}});
  auto results = procs.wait_all(Millis(60000));
  EXPECT_EQ(Processes::failures(results), "");
}

std::atomic<bool> g_kill_armed{false};
std::atomic<int> g_calls{0};

// Four stages, 1F1B, 8 microbatches; rank 2 kills itself (SIGKILL) in the forward of its 5th
// microbatch of step 1 (a layer that counts its calls), of eval's call 1 with TDIST_TEST_EVAL=1.
// Exit 3 with the error.
TDIST_TEST_CHILD(pipeline_stage_killed_child) {
  torch::set_num_threads(1);
  const auto kind = pipeline::parse_schedule(env::get("TDIST_TEST_SCHEDULE").value_or("1f1b"));
  auto pg =
      comm::create_process_group(child_store(), rank, world_size, group_options(Millis(10000)));
  // 16 layers and the killer at index 8: 17 layers, and even bounds {0, 4, 8, 12, 17} put it
  // first in stage 2.
  auto base = make_model(world_size, 5);
  torch::nn::Sequential model;
  for (size_t l = 0; l < base->size(); ++l) {
    if (l == base->size() / 2) {
      model->push_back(torch::nn::Functional([](torch::Tensor x) {
        if (g_kill_armed && ++g_calls == 5) ::raise(SIGKILL);
        return x;
      }));
    }
    model->push_back(*(base->begin() + static_cast<std::ptrdiff_t>(l)));
  }
  Pipeline pipe(PipelineStage(model, even_bounds(model->size(), world_size), rank, world_size), pg,
                options(kind, 8));
  pipe.setup(torch::zeros({16, kWidth}));
  const bool eval = env::get("TDIST_TEST_EVAL").value_or("0") == "1";
  int step = 0;
  try {
    for (step = 0; step < 3; ++step) {
      if (step == 1 && rank == 2) g_kill_armed = true;
      if (eval) {
        pipe.eval(torch::randn({16, kWidth}), torch::randn({16, kOut}));
      } else {
        pipe.step(torch::randn({16, kWidth}), torch::randn({16, kOut}));
      }
    }
  } catch (const std::exception& e) {
    std::cout << "PIPELINE ERROR at step " << step << ": " << e.what() << std::endl;
    return 3;
  }
  return 0;
}

class PipelineFailure : public ::testing::TestWithParam<std::string> {};

// The parameter: the schedule, and "_eval" for the forward-only eval instead of step.
TEST_P(PipelineFailure, StageKilledMidStepFailsEveryOtherStageNamingIt) {
  TCPStoreServer server("127.0.0.1", 0);
  const std::string param = GetParam();
  const bool eval = param.size() > 5 && param.substr(param.size() - 5) == "_eval";
  Processes procs("pipeline_stage_killed_child", 4,
                  {{"TDIST_TEST_STORE_PORT", std::to_string(server.port())},
                   {"TDIST_TEST_SCHEDULE", eval ? param.substr(0, param.size() - 5) : param},
                   {"TDIST_TEST_EVAL", eval ? "1" : "0"},
                   {"OMP_NUM_THREADS", "1"}});
  auto results = procs.wait_all(Millis(60000));
  ASSERT_EQ(results.size(), 4u);
  EXPECT_FALSE(results[2].exited) << results[2].describe() << "\n" << results[2].output;
  EXPECT_EQ(results[2].signal, SIGKILL) << results[2].describe();
  for (int r : {0, 1, 3}) {
    EXPECT_FALSE(results[r].timed_out) << "rank " << r << " hung:\n" << results[r].output;
    EXPECT_TRUE(results[r].exited && results[r].exit_code == 3) << results[r].describe() << "\n"
                                                                << results[r].output;
    EXPECT_NE(results[r].output.find("PIPELINE ERROR at step 1"), std::string::npos)
        << results[r].output;
    EXPECT_NE(results[r].output.find("lost stage 2 (rank 2"), std::string::npos)
        << results[r].output;
  }
  std::cout << "rank 0's output:\n" << results[0].output;
}

INSTANTIATE_TEST_SUITE_P(Schedules, PipelineFailure, ::testing::Values("1f1b", "zb", "1f1b_eval"));

}  // namespace
}  // namespace tdist::test
