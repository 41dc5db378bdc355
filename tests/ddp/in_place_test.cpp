// Note [DDP bucketing] 11: with the built-in hook on the CPU, DDP reduces the gradients where
// they lie (allreduce_coalesced of the .grad tensors) instead of copying them into its buckets
// and back; a gradient it cannot reduce in place goes through its bucket view, and ranks that
// differ in which gradients those are still agree on the wire. Over comm's ring group, ranks as
// threads, each group wrapped to record what DDP asks of it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <variant>

#include "tdist/comm/process_group.h"
#include "tests/ddp/ddp_test_util.h"
#include "tests/harness/spawn.h"

namespace tdist::test {
namespace {

using ddp::DDPOptions;
using ddp::DistributedDataParallel;

// Forwards every call to `inner`, keeping the tensors of each allreduce_coalesced and counting
// the plain allreduces.
class RecordingGroup : public comm::ProcessGroup {
 public:
  explicit RecordingGroup(std::shared_ptr<comm::ProcessGroup> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend_name() const override { return inner_->backend_name(); }
  const Options& options() const override { return inner_->options(); }
  std::shared_ptr<comm::Work> submit(comm::Call call) override {
    if (auto* c = std::get_if<comm::AllreduceCoalescedCall>(&call)) coalesced.push_back(c->tensors);
    if (std::holds_alternative<comm::AllreduceCall>(call)) ++allreduces;
    return inner_->submit(std::move(call));
  }
  std::shared_ptr<comm::ProcessGroup> new_group(std::vector<int> ranks,
                                                const Options& opts) override {
    return inner_->new_group(std::move(ranks), opts);
  }
  void abort() override { inner_->abort(); }

  std::vector<std::vector<at::Tensor>> coalesced;  // only the ranks' own thread touches these
  int allreduces = 0;

 private:
  std::shared_ptr<comm::ProcessGroup> inner_;
};

constexpr size_t kOdd = 2;  // fc2.weight

struct Step {
  std::vector<torch::Tensor> grads;    // after DDP's backward
  std::vector<torch::Tensor> local;    // this rank's own gradients, from a plain copy of the model
  std::vector<bool> reduced_in_place;  // per parameter: its .grad was one of the reduced tensors
  bool odd_contiguous = true;
  int allreduces = 0;
};

// One DDP step of a fresh MLP (the same on every rank) on rank-dependent data. With
// `odd_grad_rank` >= 0, that rank first gives fc2's weight a non-contiguous .grad of zeros, which
// backward accumulates into (keeping its strides).
std::vector<Step> one_step(int world, int odd_grad_rank, DDPOptions opts = {}) {
  std::vector<Step> steps(world);
  spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    torch::set_num_threads(1);
    comm::ProcessGroup::Options po;
    po.timeout = std::chrono::seconds(30);
    auto pg = std::make_shared<RecordingGroup>(comm::create_process_group(store, rank, world, po));
    // The ranks are threads sharing libtorch's generator: the nets start apart and DDP's
    // broadcast makes them equal, the plain copy is taken after it, the data draws nothing.
    // fc2's weight (64 KiB) is reduced by a run of its own, the smaller tensors packed together
    // (Note [Coalesced allreduce in place] in comm/ring/ring_process_group_ops.cpp).
    MLP net(6, 128, 3);
    MLP plain(6, 128, 3);
    DistributedDataParallel<MLP> model(net, pg, opts);
    {
      torch::NoGradGuard g;
      for (size_t i = 0; i < net->parameters().size(); ++i) {
        plain->parameters()[i].copy_(net->parameters()[i]);
      }
    }
    auto x = torch::linspace(-1, 1, 24).reshape({4, 6}) * (rank + 1);
    auto y = torch::sin(torch::linspace(0, 5, 12).reshape({4, 3}) + rank);
    auto params = model.parameters();
    if (rank == odd_grad_rank) {
      const auto& w = params[kOdd];
      params[kOdd].mutable_grad() = torch::zeros({w.size(1), w.size(0)}).t();
    }
    const int before = pg->allreduces;
    torch::mse_loss(model(x), y).backward();
    torch::mse_loss(plain(x), y).backward();
    Step& s = steps[rank];
    s.allreduces = pg->allreduces - before;
    s.odd_contiguous = params[kOdd].grad().is_contiguous();
    for (const auto& p : params) {
      s.grads.push_back(p.grad().clone());
      bool found = false;
      for (const auto& call : pg->coalesced) {
        for (const auto& t : call) found = found || t.is_same(p.grad());
      }
      s.reduced_in_place.push_back(found);
    }
    for (const auto& p : plain->parameters()) s.local.push_back(p.grad().clone());
  });
  return steps;
}

void expect_averages(const std::vector<Step>& steps) {
  const int world = static_cast<int>(steps.size());
  for (size_t i = 0; i < steps[0].grads.size(); ++i) {
    auto want = torch::zeros_like(steps[0].local[i]);
    for (const auto& s : steps) want += s.local[i];
    want /= world;
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(torch::allclose(steps[r].grads[i], want, 1e-5, 1e-6))
          << "parameter " << i << " on rank " << r;
    }
  }
}

TEST(DDPInPlace, CpuGradientsAreReducedWhereTheyLie) {
  auto steps = one_step(2, -1);
  for (const auto& s : steps) {
    EXPECT_EQ(s.allreduces, 0) << "no bucket should travel as a flat allreduce";
    for (size_t i = 0; i < s.reduced_in_place.size(); ++i) {
      EXPECT_TRUE(s.reduced_in_place[i]) << "parameter " << i << "'s .grad was copied";
    }
  }
  expect_averages(steps);
}

TEST(DDPInPlace, AnOddGradientOnOneRankGoesThroughItsBucketAndRanksStillAgree) {
  auto steps = one_step(3, 1);
  for (int r = 0; r < 3; ++r) {
    for (size_t i = 0; i < steps[r].reduced_in_place.size(); ++i) {
      EXPECT_EQ(steps[r].reduced_in_place[i], i != kOdd || r != 1)
          << "parameter " << i << " on rank " << r;
    }
  }
  EXPECT_FALSE(steps[1].odd_contiguous) << "the write-back must keep the .grad the user gave";
  expect_averages(steps);
}

TEST(DDPInPlace, BucketViewsStillTravelAsTheirBucket) {
  DDPOptions o;
  o.gradient_as_bucket_view = true;
  auto steps = one_step(2, -1, o);
  for (const auto& s : steps) {
    EXPECT_GE(s.allreduces, 1);
    for (bool in_place : s.reduced_in_place) EXPECT_FALSE(in_place);
  }
  expect_averages(steps);
}

}  // namespace
}  // namespace tdist::test
