// Schedules as data: every action exactly once per rank, the simulated bubble and memory of
// Note [Pipeline schedules], bad arguments; stage splitting.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>
#include <tuple>

#include "tdist/core/error.h"
#include "tdist/pipeline/schedule.h"
#include "tdist/pipeline/stage.h"
#include "tdist/pipeline/timeline.h"

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
            // Each receive is posted before its action, at the latest p actions ahead, and no
            // later than the action this rank runs when its sender starts the message.
            const auto post = s.receive_post_index(r, p);
            ASSERT_EQ(post.size(), s.actions[r].size());
            std::vector<int64_t> start(s.actions[r].size(), -1);
            for (size_t t = 0; t < s.timetable[r].size(); ++t) {
              const int k = s.timetable[r][t];
              if (k >= 0 && start[k] < 0) start[k] = static_cast<int64_t>(t);
            }
            for (size_t k = 0; k < post.size(); ++k) {
              const Action& a = s.actions[r][k];
              const int st = a.chunk * p + r;
              int q = -1;
              if (a.type == Type::kForward && st > 0) q = st - 1;
              if ((a.type == Type::kBackward || a.type == Type::kBackwardInput) && st + 1 < p * v) {
                q = st + 1;
              }
              if (q < 0) {
                EXPECT_EQ(post[k], k);  // receives nothing
                continue;
              }
              EXPECT_LE(post[k], k > static_cast<size_t>(p) ? k - p : 0) << to_string(a, true);
              int64_t produced = -1;
              const auto& theirs = s.actions[q % p];
              for (size_t j = 0; j < theirs.size(); ++j) {
                if (theirs[j] == Action{a.type, a.microbatch, q / p}) {
                  for (size_t t = 0; t < s.timetable[q % p].size(); ++t) {
                    if (s.timetable[q % p][t] == static_cast<int>(j)) {
                      produced = static_cast<int64_t>(t);
                      break;
                    }
                  }
                }
              }
              ASSERT_GE(produced, 0) << to_string(a, true);
              // (Index 0 is as early as a step can post.)
              if (post[k] > 0) {
                EXPECT_LE(start[post[k]], produced) << to_string(a, true) << " on rank " << r;
              }
            }
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
      // The measured bubble (timeline.h) of timelines that follow the simulated timetables
      // exactly is the simulated bubble: both are idle time over p times the makespan.
      for (const Schedule* sched : {&gpipe, &one, &zb}) {
        int64_t compute = 0, begin = INT64_MAX, end = 0;
        for (int r = 0; r < p; ++r) {
          StepTimeline tl;
          tl.begin_us = -5000;  // before the first action: time outside the makespan
          for (size_t t = 0; t < sched->timetable[r].size(); ++t) {
            if (sched->timetable[r][t] < 0) continue;
            const int64_t at = 1000 * static_cast<int64_t>(t);
            tl.events.push_back({"wait", at - 1, at, false});
            tl.events.push_back({"x", at, at + 1000, true});
          }
          tl.end_us = 1000 * static_cast<int64_t>(sched->timetable[r].size()) + 7000;
          compute += tl.compute_us();
          begin = std::min(begin, tl.compute_begin_us());
          end = std::max(end, tl.compute_end_us());
        }
        EXPECT_NEAR(pipeline_bubble(compute, p, begin, end), sched->simulated_bubble(), 1e-12)
            << to_string(sched->kind) << " p=" << p << " m=" << m;
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
