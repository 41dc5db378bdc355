// Mixed precision (Note [Sharded data parallel] 8): units compute in bf16 on gathered bf16
// parameters, gradients are reduced in reduce_dtype, and the sharded master copy, its gradient
// and Adam's state stay fp32. The oracle is one process computing the same way: each rank's
// rows through a bf16 copy of the fp32 master, the bf16 gradients averaged in fp32 (or rounded
// to bf16 first), Adam on the fp32 master.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>

#include "tdist/fsdp/detail/param_group.h"
#include "tests/fsdp/fsdp_test_util.h"

namespace tdist::test {
namespace {

constexpr int kSteps = 20;

struct MixedCase {
  int world = 2;
  int shard_size = 0;
  c10::ScalarType compute = torch::kBFloat16;
  c10::ScalarType reduce = torch::kFloat;
};

// One process: per step, each rank's rows through a copy of the master in `compute`, its
// gradients cast to `reduce`, divided by the world size and summed, then cast to fp32 for Adam.
std::vector<torch::Tensor> train_reference(const MixedCase& c,
                                           const std::vector<torch::Tensor>& init,
                                           const std::vector<Batch>& batches) {
  Net master;
  load_values(*master, init);
  torch::optim::Adam opt(master->parameters(), torch::optim::AdamOptions(kLr));
  Net low;
  low->to(c.compute);
  auto master_params = master->parameters();
  auto low_params = low->parameters();
  for (const Batch& b : batches) {
    std::vector<torch::Tensor> sum;
    for (const auto& p : master_params) sum.push_back(torch::zeros_like(p, c.reduce));
    for (int r = 0; r < c.world; ++r) {
      load_values(*low, values_of(*master));  // copy_ rounds to `compute`
      low->zero_grad();
      auto out = low->forward(rows_of(b.x, r, c.world).to(c.compute));
      torch::mse_loss(out.to(torch::kFloat), rows_of(b.y, r, c.world)).backward();
      for (size_t i = 0; i < sum.size(); ++i) {
        // FSDP: the engine casts the gradient to the master's dtype, then to reduce_dtype.
        sum[i] += low_params[i].grad().to(torch::kFloat).to(c.reduce) / c.world;
      }
    }
    opt.zero_grad();
    for (size_t i = 0; i < sum.size(); ++i) {
      master_params[i].mutable_grad() = sum[i].to(torch::kFloat);
    }
    opt.step();
  }
  return values_of(*master);
}

std::vector<std::vector<torch::Tensor>> train_fsdp(const MixedCase& c,
                                                   const std::vector<torch::Tensor>& init,
                                                   const std::vector<Batch>& batches) {
  std::vector<std::vector<torch::Tensor>> got(c.world);
  spawn(c.world, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = make_group(store, rank, c.world);
    Net net;
    load_values(*net, init);
    fsdp::FSDPOptions opts;
    opts.shard_size = c.shard_size;
    opts.param_dtype = c.compute;
    opts.reduce_dtype = c.reduce;
    auto model = fsdp::fully_shard(net, units_of(net), pg, opts);
    auto& st = model.state();
    size_t root_padded = 0;
    for (size_t g = 0; g < st.num_groups(); ++g) {
      if (st.group(g).name() == "(root)") root_padded = size_t(st.group(g).padded_numel());
    }
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(kLr));
    for (int s = 0; s < kSteps; ++s) {
      const Batch& b = batches[s];
      opt.zero_grad();
      auto out = model(rows_of(b.x, rank, c.world));  // fp32 input, cast by the root
      EXPECT_EQ(out.scalar_type(), c.compute) << "the units did not compute in param_dtype";
      // Only the root's group is still gathered, in param_dtype's element size.
      EXPECT_EQ(model.unsharded_bytes(), root_padded * c10::elementSize(c.compute));
      EXPECT_EQ(net->scale.scalar_type(), c.compute);
      torch::mse_loss(out.to(torch::kFloat), rows_of(b.y, rank, c.world)).backward();
      for (const auto& p : model.parameters()) {
        EXPECT_EQ(p.scalar_type(), torch::kFloat) << "the master shard is not fp32";
        ASSERT_TRUE(p.grad().defined());
        EXPECT_EQ(p.grad().scalar_type(), torch::kFloat) << "the shard's gradient is not fp32";
      }
      opt.step();
    }
    for (const auto& [key, state] : opt.state()) {
      auto& s = static_cast<torch::optim::AdamParamState&>(*state);
      EXPECT_EQ(s.exp_avg().scalar_type(), torch::kFloat);
      EXPECT_EQ(s.exp_avg_sq().scalar_type(), torch::kFloat);
    }
    got[rank] = full_values(model.full_parameters());
    for (const auto& t : got[rank]) EXPECT_EQ(t.scalar_type(), torch::kFloat);
  });
  return got;
}

// Runs case c and returns the largest difference from the reference over ranks; checks that
// the same run in fp32 ends elsewhere (so `tolerance` tells bf16 from fp32 apart).
double mixed_gap(const MixedCase& c, double tolerance) {
  torch::manual_seed(21);
  Net init_net;
  auto init = values_of(*init_net);
  auto batches = make_batches(kSteps, 4 * c.world, 23);
  auto want = train_reference(c, init, batches);
  MixedCase full = c;
  full.compute = torch::kFloat;
  full.reduce = torch::kFloat;
  const double fp32_gap = max_abs_diff(want, train_reference(full, init, batches));
  EXPECT_GT(max_abs_diff(init, want), 1e-3);
  auto got = train_fsdp(c, init, batches);
  double gap = 0;
  for (int r = 0; r < c.world; ++r) {
    const double d = max_abs_diff(want, got[r]);
    EXPECT_LE(d, tolerance) << "rank " << r;
    gap = std::max(gap, d);
  }
  EXPECT_GT(fp32_gap, 5 * tolerance) << "the tolerance does not tell bf16 from fp32";
  std::cout << "world " << c.world << " shard_size " << c.shard_size << " reduce "
            << c10::toString(c.reduce) << ": gap to the reference " << gap << ", fp32's "
            << fp32_gap << "\n";
  return gap;
}

TEST(FSDPMixedPrecision, Bf16ComputeFp32ReduceMatchesTheReferenceWorld2) {
  mixed_gap({2, 0, torch::kBFloat16, torch::kFloat}, 1e-4);
}

TEST(FSDPMixedPrecision, Bf16ComputeFp32ReduceUnderHSDPWorld4) {
  mixed_gap({4, 2, torch::kBFloat16, torch::kFloat}, 1e-4);
}

// Reduced in bf16, the collective rounds its partial sums to bf16 in its own order, not the
// reference's: a bf16 tolerance.
TEST(FSDPMixedPrecision, Bf16ComputeBf16ReduceWithinBf16ToleranceWorld3) {
  mixed_gap({3, 0, torch::kBFloat16, torch::kBFloat16}, 2e-3);
}

TEST(FSDPMixedPrecision, NonFloatingDtypesAreRefused) {
  spawn(1, [](int rank, std::shared_ptr<Store> store) {
    auto pg = make_group(store, rank, 1);
    for (bool reduce : {false, true}) {
      Net net;
      fsdp::FSDPOptions opts;
      (reduce ? opts.reduce_dtype : opts.param_dtype) = torch::kInt;
      try {
        fsdp::fully_shard(net, units_of(net), pg, opts);
        ADD_FAILURE() << "no error";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(reduce ? "reduce_dtype Int is not floating point"
                                                    : "param_dtype Int is not floating point"),
                  std::string::npos)
            << e.what();
      }
    }
  });
}

}  // namespace
}  // namespace tdist::test
