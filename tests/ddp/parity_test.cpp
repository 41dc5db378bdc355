// Parity: N DDP ranks, each on its shard, end with the parameters of one process trained on
// the whole batch (within 1e-5 after K SGD steps).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/ddp/reducer.h"
#include "tests/ddp/ddp_test_util.h"

namespace tdist::test {
namespace {

using ddp::DDPOptions;
using ddp::DistributedDataParallel;

ParityCase<MLP> mlp_case(int world) {
  ParityCase<MLP> c;
  c.make = [] { return MLP(); };
  c.world = world;
  return c;
}

TEST(DDPParity, MLPWorld1) { expect_parity(mlp_case(1), {6}); }
TEST(DDPParity, MLPWorld2) { expect_parity(mlp_case(2), {6}); }
TEST(DDPParity, MLPWorld3) { expect_parity(mlp_case(3), {6}); }
TEST(DDPParity, MLPWorld4) { expect_parity(mlp_case(4), {6}); }

TEST(DDPParity, ConvNet) {
  ParityCase<ConvNet> c;
  c.make = [] { return ConvNet(); };
  expect_parity(c, {1, 8, 8});
}

TEST(DDPParity, BatchNormBuffersFromRankZero) {
  ParityCase<BNNet> c;
  c.make = [] { return BNNet(); };
  c.whole_batch_reference = false;  // BatchNorm normalizes each rank's shard by its own stats
  expect_parity(c, {6});
}

// Rank 0's rows take BranchNet's branch, rank 1's do not (world 2, 4 rows per rank).
void split_branch(std::vector<Batch>& batches) {
  for (auto& b : batches) {
    auto f = b.x.select(1, 0);
    f.narrow(0, 0, 4).abs_();
    f.narrow(0, 4, 4).abs_().neg_();
  }
}

TEST(DDPParity, UnusedParametersFound) {
  // `unused` is never used; `branch` is used only by shards whose first feature sums positive.
  ParityCase<BranchNet> c;
  c.make = [] { return BranchNet(); };
  c.whole_batch_reference = false;  // the branch is taken per shard
  c.opts.find_unused_parameters = true;
  c.adjust_batches = split_branch;
  c.inspect = [](int, DistributedDataParallel<BranchNet>& m) {
    // No rank used it: its gradient stays undefined, as in one process.
    EXPECT_FALSE(m.module()->unused->weight.grad().defined());
    EXPECT_TRUE(m.module()->fc1->weight.grad().defined());
  };
  expect_parity(c, {6});
}

TEST(DDPParity, UnusedParametersStaticGraph) {
  ParityCase<BranchNet> c;
  c.make = [] { return BranchNet(); };
  c.whole_batch_reference = false;
  c.opts.static_graph = true;
  c.adjust_batches = split_branch;
  c.steps = 4;
  expect_parity(c, {6});
}

TEST(DDPParity, NoSyncAccumulation) {
  auto c = mlp_case(2);
  c.accumulate = 3;
  expect_parity(c, {6});
}

TEST(DDPParity, GradientAsBucketView) {
  auto c = mlp_case(2);
  c.opts.gradient_as_bucket_view = true;
  c.inspect = [](int, DistributedDataParallel<MLP>& m) {
    // Gradients of one bucket share one storage (the bucket).
    auto buckets = m.reducer().bucket_indices();
    auto params = m.parameters();
    ASSERT_EQ(buckets.size(), 1u);
    for (size_t i : buckets[0]) {
      EXPECT_TRUE(params[i].grad().is_alias_of(params[buckets[0][0]].grad())) << "param " << i;
    }
  };
  expect_parity(c, {6});
}

TEST(DDPParity, GradientAsBucketViewWithNoSync) {
  auto c = mlp_case(2);
  c.opts.gradient_as_bucket_view = true;
  c.opts.bucket_cap_mb = 1e-4;  // several buckets
  c.accumulate = 2;
  expect_parity(c, {6});
}

TEST(DDPParity, TinyBucketCapOneBucketPerParameter) {
  auto c = mlp_case(3);
  c.opts.bucket_cap_mb = 1e-6;
  c.inspect = [](int, DistributedDataParallel<MLP>& m) {
    EXPECT_EQ(m.reducer().num_buckets(), m.parameters().size());
  };
  expect_parity(c, {6});
}

TEST(DDPParity, HugeBucketCapOneBucket) {
  auto c = mlp_case(2);
  c.opts.bucket_cap_mb = 1e4;
  c.opts.first_bucket_cap_mb = 1e4;
  c.inspect = [](int, DistributedDataParallel<MLP>& m) {
    EXPECT_EQ(m.reducer().num_buckets(), 1u);
  };
  expect_parity(c, {6});
}

TEST(DDPParity, BroadcastBuffersOff) {
  // Without the broadcast each rank keeps its own running statistics; parameters still match.
  ParityCase<BNNet> c;
  c.make = [] { return BNNet(); };
  c.whole_batch_reference = false;
  c.opts.broadcast_buffers = false;
  c.steps = 1;  // one step: rank 0's statistics equal the reference's
  expect_parity(c, {6});
}

}  // namespace
}  // namespace tdist::test
