// Schedules as data: every action exactly once per rank, the simulated bubble and memory of
// Note [Pipeline schedules], bad arguments; stage splitting.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>
#include <tuple>

#include "tdist/core/error.h"
#include "tdist/pipeline/schedule.h"
#include "tdist/pipeline/stage.h"

namespace tdist::pipeline {
namespace {

using Type = Action::Type;

TEST(PipelineSchedule, EveryRankRunsEachActionOnceInDependencyOrder) {
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B,
                    ScheduleKind::kZeroBubbleH1}) {
    const bool inter = kind == ScheduleKind::kInterleaved1F1B;
    for (int v : inter ? std::vector<int>{2, 3} : std::vector<int>{1}) {
      for (int p = 1; p <= 4; ++p) {
        for (int m : {1, p, 2 * p + 1, 8}) {
          SCOPED_TRACE(to_string(kind) + " v=" + std::to_string(v) + " p=" + std::to_string(p) +
                       " m=" + std::to_string(m));
          auto s = make_schedule(kind, p, m, v);
          ASSERT_EQ(s.actions.size(), static_cast<size_t>(p));
          const bool split = kind == ScheduleKind::kZeroBubbleH1;
          for (int r = 0; r < p; ++r) {
            std::set<std::tuple<int, int, int>> seen;
            for (const Action& a : s.actions[r]) {
              EXPECT_TRUE(seen.insert({static_cast<int>(a.type), a.microbatch, a.chunk}).second)
                  << to_string(a, true) << " twice on rank " << r;
              // On one rank, F precedes B/I of the same microbatch and chunk, which precedes W.
              if (a.type != Type::kForward) {
                EXPECT_TRUE(seen.count({static_cast<int>(Type::kForward), a.microbatch, a.chunk}));
              }
              if (a.type == Type::kBackwardWeight) {
                EXPECT_TRUE(
                    seen.count({static_cast<int>(Type::kBackwardInput), a.microbatch, a.chunk}));
              }
            }
            EXPECT_EQ(seen.size(), static_cast<size_t>(m * v * (split ? 3 : 2)));
          }
        }
      }
    }
  }
}

TEST(PipelineSchedule, BubbleAndMemoryAreTheNotes) {
  for (int p = 2; p <= 4; ++p) {
    for (int m : {1, p, 2 * p + 1, 8}) {
      auto gpipe = make_schedule(ScheduleKind::kGPipe, p, m);
      auto one = make_schedule(ScheduleKind::k1F1B, p, m);
      auto zb = make_schedule(ScheduleKind::kZeroBubbleH1, p, m);
      EXPECT_NEAR(gpipe.simulated_bubble(), analytic_bubble(p, m), 1e-12);
      EXPECT_NEAR(one.simulated_bubble(), analytic_bubble(p, m), 1e-12);
      if (m >= p) {
        EXPECT_LT(zb.simulated_bubble(), one.simulated_bubble()) << "p=" << p << " m=" << m;
        EXPECT_LT(make_schedule(ScheduleKind::kInterleaved1F1B, p, 2 * p, 2).simulated_bubble(),
                  make_schedule(ScheduleKind::k1F1B, p, 2 * p).simulated_bubble());
      }
      const auto g = gpipe.peak_in_flight(), o = one.peak_in_flight(), z = zb.peak_in_flight();
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(g[r], m);
        EXPECT_EQ(o[r], std::min(m, p - r)) << "1F1B rank " << r;
        EXPECT_LE(z[r], std::min(m, p - r)) << "ZB-H1 rank " << r;
      }
    }
  }
}

TEST(PipelineSchedule, BadArgumentsAreClearErrors) {
  EXPECT_THROW(parse_schedule("pipedream"), InvalidArgument);
  EXPECT_EQ(parse_schedule("zb"), ScheduleKind::kZeroBubbleH1);
  EXPECT_THROW(make_schedule(ScheduleKind::k1F1B, 0, 4), InvalidArgument);
  EXPECT_THROW(make_schedule(ScheduleKind::k1F1B, 2, 0), InvalidArgument);
  EXPECT_THROW(make_schedule(ScheduleKind::k1F1B, 2, 4, 2), InvalidArgument);
  EXPECT_THROW(make_schedule(ScheduleKind::kInterleaved1F1B, 2, 4, 1), InvalidArgument);
  try {
    parse_schedule("pipedream");
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("gpipe, 1f1b, interleaved, zb"), std::string::npos);
  }
}

TEST(PipelineStage, SplitsByParameterCountAndChecksBounds) {
  torch::nn::Sequential model(torch::nn::Linear(10, 10), torch::nn::ReLU(),         // 110
                              torch::nn::Linear(10, 2), torch::nn::ReLU(),          // 22
                              torch::nn::Linear(2, 2), torch::nn::Linear(2, 100));  // 6, 300
  EXPECT_EQ(PipelineStage::balanced_bounds(model, 2), (std::vector<int64_t>{0, 5, 6}));
  EXPECT_EQ(PipelineStage::balanced_bounds(model, 3), (std::vector<int64_t>{0, 1, 5, 6}));
  EXPECT_THROW(PipelineStage::balanced_bounds(model, 7), InvalidArgument);
  EXPECT_EQ(PipelineStage::bounds_from_split_points(model, {2, 4}),
            (std::vector<int64_t>{0, 2, 4, 6}));
  EXPECT_THROW(PipelineStage(model, {0, 3, 3, 6}, 0, 3), InvalidArgument);  // empty stage
  EXPECT_THROW(PipelineStage(model, {0, 3, 5}, 0, 2), InvalidArgument);     // not the end
  EXPECT_THROW(PipelineStage(model, {0, 2, 4, 6}, 0, 2), InvalidArgument);  // 3 over 2 ranks
  PipelineStage inter(model, {0, 1, 2, 4, 6}, 1, 2);  // rank 1 holds stages 1 and 3
  EXPECT_EQ(inter.num_chunks(), 2);
  EXPECT_EQ(inter.stage_index(1), 3);
  EXPECT_EQ(inter.chunk(1)->size(), 2u);
  // The chunks share the model's parameters.
  EXPECT_TRUE(inter.chunk(1)->parameters()[0].is_same(model[4]->parameters()[0]));
  EXPECT_EQ(inter.describe_stage(3), "stage 3 (rank 1, layers [4, 6))");
}

}  // namespace
}  // namespace tdist::pipeline
