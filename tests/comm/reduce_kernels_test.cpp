#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/comm/engine/reduce_kernels.h"
#include "tests/comm/comm_test_util.h"

namespace tdist::comm {
namespace {

// Every (dtype, op) kernel against the reference, on an odd length that exercises the
// vectorized body and its tail.
TEST(ReduceKernels, EveryDtypeAndOpMatchesReference) {
  for (auto t : test::all_dtypes()) {
    for (auto op : test::all_ops()) {
      SCOPED_TRACE(std::string(c10::toString(t)) + " " + to_string(op));
      if (!test::op_supported(t, op)) {
        EXPECT_FALSE(detail::reduce_supported(t, op));
        EXPECT_THROW(detail::reduce_kernel(t, op), InvalidArgument);
        continue;
      }
      auto a = test::make_input(t, op, 1027, 0);
      auto b = test::make_input(t, op, 1027, 1);
      auto want = test::reference({a, b}, op == ReduceOp::AVG ? ReduceOp::SUM : op);
      auto out = a.clone();
      detail::reduce_kernel(t, op)(out.data_ptr(), out.data_ptr(), b.data_ptr(), 1027);
      EXPECT_TRUE(test::same(out, want)) << test::describe(out) << " vs " << test::describe(want);
    }
  }
}

TEST(ReduceKernels, DivideForAvg) {
  auto x = torch::full({5}, 3.0, torch::kHalf);
  detail::divide_in_place(x.data_ptr(), x.scalar_type(), 5, 2);
  EXPECT_TRUE(torch::equal(x, torch::full({5}, 1.5, torch::kHalf)));
  auto i = torch::ones({2}, torch::kInt);
  EXPECT_THROW(detail::divide_in_place(i.data_ptr(), i.scalar_type(), 2, 2), InvalidArgument);
}

}  // namespace
}  // namespace tdist::comm
