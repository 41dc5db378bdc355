// Every schedule at p = 2, 3, 4 ranks (real processes) and m in {1, p, 2p + 1}: the loss and
// every gradient equal one single-process step of the same model on the same batch, and after
// each step a forward-only eval gives the model's output and loss. One spawn per p runs every
// schedule and m; each child counts its mismatches (printed) as its exit code.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <sstream>

#include "tests/harness/process.h"
#include "tests/pipeline/pipeline_test_util.h"

namespace tdist::test {
namespace {

using pipeline::Pipeline;
using pipeline::PipelineOptions;
using pipeline::PipelineStage;
using pipeline::ScheduleKind;

constexpr double kTol = 1e-5;

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

// One combination; returns the number of mismatches.
int check_parity(const std::shared_ptr<comm::ProcessGroup>& pg, ScheduleKind kind, int m,
                 const std::string& trace) {
  const int p = pg->size();
  const int rank = pg->rank();
  const uint64_t seed = 100 + static_cast<uint64_t>(m) * 7 + static_cast<uint64_t>(kind);
  auto model = make_model(p, seed);
  auto reference = make_model(p, seed);
  const int64_t layers = static_cast<int64_t>(model->size());
  std::vector<int64_t> bounds;
  if (kind == ScheduleKind::kInterleaved1F1B) {
    bounds = even_bounds(layers, 2 * p);
  } else if (kind == ScheduleKind::kGPipe) {
    bounds = even_bounds(layers, p);
  } else {
    bounds = PipelineStage::balanced_bounds(model, p);
  }
  PipelineOptions o;
  o.schedule = kind;
  o.microbatches = m;
  o.loss_fn = mse;
  PipelineStage stage(model, bounds, rank, p);
  Pipeline pipe(stage, pg, o);
  const int64_t batch = 2 * m;
  torch::manual_seed(seed + 1);
  pipe.setup(torch::zeros({batch, kWidth}));
  int bad = 0;
  const std::string what = str(pipeline::to_string(kind), " p=", p, " m=", m, " rank ", rank);
  for (int step = 0; step < 2; ++step) {
    auto x = torch::randn({batch, kWidth});
    auto y = torch::randn({batch, kOut});
    for (auto& t : model->parameters()) t.mutable_grad() = at::Tensor();
    for (auto& t : reference->parameters()) t.mutable_grad() = at::Tensor();
    auto loss = pipe.step(x, y);
    auto ref_loss = mse(reference->forward(x), y);
    ref_loss.backward();
    const bool last = stage.stage_index(stage.num_chunks() - 1) == stage.num_stages() - 1;
    if (last != loss.defined()) {
      std::cout << what << ": loss defined " << loss.defined() << " on the last stage " << last
                << "\n";
      ++bad;
    }
    if (loss.defined() && std::abs(loss.item<double>() - ref_loss.item<double>()) > kTol) {
      std::cout << what << ": loss " << loss.item<double>() << " vs " << ref_loss.item<double>()
                << "\n";
      ++bad;
    }
    auto mine = stage.parameters();
    auto theirs = stage_params_of(reference, stage);
    if (mine.size() != theirs.size() || mine.empty()) {
      std::cout << what << ": " << mine.size() << " parameters vs " << theirs.size() << "\n";
      return bad + 1;
    }
    for (size_t k = 0; k < mine.size(); ++k) {
      if (!mine[k].grad().defined()) {
        std::cout << what << ": parameter " << k << " has no gradient\n";
        ++bad;
        continue;
      }
      const double d = max_diff(mine[k].grad(), theirs[k].grad());
      if (d > kTol) {
        std::cout << what << " step " << step << ": parameter " << k << " gradient differs by " << d
                  << "\n";
        ++bad;
      }
    }
    // Forward only on another batch (the next step still matches, so eval left the pipeline
    // as it was): the last stage's output and loss equal the reference's; no gradient moved.
    std::vector<at::Tensor> grads;
    for (auto& t : mine) grads.push_back(t.grad().clone());
    auto xe = torch::randn({batch, kWidth});
    auto ye = torch::randn({batch, kOut});
    auto e = pipe.eval(xe, step == 0 ? ye : at::Tensor());
    torch::NoGradGuard no_grad;
    auto ref_out = reference->forward(xe);
    if (last != e.output.defined() || (last && step == 0) != e.loss.defined()) {
      std::cout << what << ": eval output defined " << e.output.defined() << ", loss defined "
                << e.loss.defined() << " on the last stage " << last << "\n";
      ++bad;
    } else if (last) {
      const double d = e.output.sizes() == ref_out.sizes() ? max_diff(e.output, ref_out) : 1e9;
      if (d > kTol || e.output.requires_grad()) {
        std::cout << what << ": eval output differs by " << d << ", requires grad "
                  << e.output.requires_grad() << "\n";
        ++bad;
      }
      if (step == 0 && std::abs(e.loss.item<double>() - mse(ref_out, ye).item<double>()) > kTol) {
        std::cout << what << ": eval loss " << e.loss.item<double>() << " vs "
                  << mse(ref_out, ye).item<double>() << "\n";
        ++bad;
      }
    }
    for (size_t k = 0; k < mine.size(); ++k) {
      if (!torch::equal(mine[k].grad(), grads[k])) {
        std::cout << what << ": eval changed the gradient of parameter " << k << "\n";
        ++bad;
      }
    }
  }
  const double bubble = pipe.bubble_fraction();
  if (!(bubble >= 0.0 && bubble < 1.0)) {
    std::cout << what << ": bubble fraction " << bubble << "\n";
    ++bad;
  }
  if (!trace.empty()) pipe.write_trace(trace);
  return bad;
}

TDIST_TEST_CHILD(pipeline_parity_child) {
  torch::set_num_threads(1);
  auto pg =
      comm::create_process_group(child_store(), rank, world_size, group_options(Millis(60000)));
  const std::string trace_dir = env::get("TDIST_TEST_TRACE_DIR").value_or("");
  int bad = 0;
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B,
                    ScheduleKind::kZeroBubbleH1}) {
    for (int m : {1, world_size, 2 * world_size + 1}) {
      const bool traced = !trace_dir.empty() && kind == ScheduleKind::k1F1B && m == world_size;
      bad += check_parity(pg, kind, m, traced ? trace_dir + "/pipe.json" : std::string());
    }
  }
  std::cout << "rank " << rank << ": " << bad << " mismatches" << std::endl;
  return std::min(bad, 100);
}

class PipelineParity : public ::testing::TestWithParam<int> {};

TEST_P(PipelineParity, EveryScheduleMatchesSingleProcessTraining) {
  const int p = GetParam();
  TCPStoreServer server("127.0.0.1", 0);
  const std::string dir = temp_dir("tdist-pipeline");
  Processes procs("pipeline_parity_child", p,
                  {{"TDIST_TEST_STORE_PORT", std::to_string(server.port())},
                   {"TDIST_TEST_TRACE_DIR", dir},
                   {"OMP_NUM_THREADS", "1"}});
  auto results = procs.wait_all(Millis(100000));
  EXPECT_EQ(Processes::failures(results), "");
  // Each rank wrote its timeline of the traced combination: Chrome-trace JSON with its actions.
  for (int r = 0; r < p; ++r) {
    std::ifstream f(dir + "/pipe.rank" + std::to_string(r) + ".json");
    ASSERT_TRUE(f.good()) << "rank " << r << " wrote no trace";
    std::stringstream ss;
    ss << f.rdbuf();
    const std::string text = ss.str();
    EXPECT_NE(text.find("\"traceEvents\""), std::string::npos);
    EXPECT_NE(text.find("\"name\": \"F0\""), std::string::npos) << text.substr(0, 400);
    EXPECT_NE(text.find("\"name\": \"B0\""), std::string::npos) << text.substr(0, 400);
    EXPECT_NE(text.find("idle_fraction"), std::string::npos);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, PipelineParity, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "p" + std::to_string(info.param); });

}  // namespace
}  // namespace tdist::test
