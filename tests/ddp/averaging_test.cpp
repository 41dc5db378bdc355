// The built-in averaging of gradients: reduced-precision gradients whose sum over the ranks does
// not fit the dtype (fp16: world * |g| > 65504) still average to a finite, exact value, because
// each rank divides by the world size before the allreduce (as PyTorch's Reducer does).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/comm/process_group.h"
#include "tests/ddp/ddp_test_util.h"
#include "tests/harness/spawn.h"

namespace tdist::test {
namespace {

using ddp::DDPOptions;
using ddp::DistributedDataParallel;

// One fp16 parameter; forward (w * x).sum() makes the gradient of w exactly x.
struct HalfParamImpl : torch::nn::Module {
  HalfParamImpl() : w(register_parameter("w", torch::ones({4}, torch::kHalf))) {}
  torch::Tensor forward(const torch::Tensor& x) { return (w * x).sum(); }
  torch::Tensor w;
};
TORCH_MODULE(HalfParam);

// Rank r's gradient: 32768 + 1024 r in every element (multiples of 32 * world, so that each
// g / world and their sum are exact in fp16). Every one fits fp16, their sum does not.
float rank_gradient(int rank) { return 32768.0f + 1024.0f * static_cast<float>(rank); }

float expected_average(int world) {
  double sum = 0;
  for (int r = 0; r < world; ++r) sum += rank_gradient(r);
  return static_cast<float>(sum / world);
}

// Runs one synchronized backward on `pg` and checks w.grad against the exact average.
void check_half_average(int rank, std::shared_ptr<comm::ProcessGroup> pg, bool as_bucket_view) {
  const int world = pg->size();
  HalfParam net;
  DDPOptions opts;
  opts.gradient_as_bucket_view = as_bucket_view;
  DistributedDataParallel<HalfParam> model(net, pg, opts);
  auto x = torch::full({4}, rank_gradient(rank), torch::kHalf);
  model(x).backward();
  torch::Tensor grad = net->w.grad();
  ASSERT_TRUE(grad.defined());
  ASSERT_EQ(grad.scalar_type(), torch::kHalf);
  EXPECT_TRUE(torch::isfinite(grad).all().item<bool>())
      << "rank " << rank << " of " << world << ": the averaged fp16 gradient overflowed: " << grad;
  EXPECT_TRUE(torch::equal(grad, torch::full({4}, expected_average(world), torch::kHalf)))
      << "rank " << rank << " of " << world << ": got " << grad << ", expected "
      << expected_average(world) << " (bucket view " << as_bucket_view << ")";
}

class HalfAverage : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(HalfAverage, SumBeyondFp16RangeStaysFinite) {
  torch::set_num_threads(1);
  const auto [world, as_bucket_view] = GetParam();
  // The sum of the raw gradients is beyond fp16's range: the test is about that case.
  ASSERT_GT(expected_average(world) * world, 65504.0f);
  run_ranks(world, [&](int rank, std::shared_ptr<comm::ProcessGroup> pg) {
    check_half_average(rank, pg, as_bucket_view);
  });
}

INSTANTIATE_TEST_SUITE_P(DDPAveraging, HalfAverage,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Bool()),
                         [](const auto& info) {
                           return "World" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "BucketView" : "Copy");
                         });

// The same over comm's ring group (TCP on this host), whose fp16 reduction keeps partial sums in
// fp16 between the steps of the algorithm.
TEST(DDPAveraging, HalfSumBeyondRangeStaysFiniteOverRingGroup) {
  torch::set_num_threads(1);
  for (int world : {2, 4}) {
    spawn(world, [&](int rank, std::shared_ptr<Store> store) {
      comm::ProcessGroup::Options po;
      po.timeout = std::chrono::seconds(30);
      auto pg = comm::create_process_group(store, rank, world, po);
      check_half_average(rank, pg, /*as_bucket_view=*/false);
    });
  }
}

}  // namespace
}  // namespace tdist::test
