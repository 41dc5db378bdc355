// tdist-bench collective's check (apps/bench/check.h): the expected outputs pass, and outputs with
// a planted defect fail in most of their elements: shifted by one element, by five (the period of
// the inputs before issue 40, which hid such a shift), by a block; a block from the wrong rank;
// a reduce-scatter's block reduced from the wrong piece.

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <string>

#include "apps/bench/check.h"

namespace tdist::bench {
namespace {

using comm::ReduceOp;

const char* const kOps[] = {"allreduce", "broadcast", "reduce",         "allgather",
                            "gather",    "scatter",   "reduce_scatter", "alltoall"};

TEST(BenchCheck, ExpectedOutputsPassAndShiftedOnesFail) {
  for (int world : {2, 3, 4, 8}) {
    const int64_t count = 840 * world;
    for (const std::string op : kOps) {
      for (int rank = 0; rank < world; ++rank) {
        SCOPED_TRACE(op + " world " + std::to_string(world) + " rank " + std::to_string(rank));
        const int root = world - 1;
        const at::Tensor want =
            expected_output(op, ReduceOp::SUM, at::kFloat, rank, world, root, count);
        if (op == "gather" && rank != root) {
          EXPECT_FALSE(want.defined());
          continue;
        }
        ASSERT_TRUE(want.defined());
        EXPECT_EQ(count_wrong(want.to(at::kFloat), want), 0);
        const int64_t n = want.numel();
        // Most elements of a shifted result differ from the expected ones.
        for (int64_t shift : {int64_t{1}, int64_t{5}, n / world}) {
          EXPECT_GT(count_wrong(want.roll(shift), want), n / 2) << "shifted by " << shift;
        }
      }
    }
  }
}

TEST(BenchCheck, ABlockFromTheWrongRankOrPieceFails) {
  const int world = 4;
  const int64_t count = 4000;
  for (int rank = 0; rank < world; ++rank) {
    const int other = (rank + 1) % world;
    // A reduce-scatter's block: the sum of another block.
    const at::Tensor rs =
        expected_output("reduce_scatter", ReduceOp::SUM, at::kFloat, rank, world, 0, count);
    const at::Tensor rs_other =
        expected_output("reduce_scatter", ReduceOp::SUM, at::kFloat, other, world, 0, count);
    EXPECT_GT(count_wrong(rs_other, rs), rs.numel() / 2);
    // The same sum with one rank's addend from the wrong position (a window too early).
    const at::Tensor mixed =
        rs - input_values(other, count).narrow(0, rank * 1000, 1000) +
        input_values(other, count).narrow(0, ((rank + 2) % world) * 1000, 1000);
    EXPECT_GT(count_wrong(mixed, rs), rs.numel() / 2);
    // A broadcast or an alltoall block from the wrong rank.
    EXPECT_GT(count_wrong(input_values(other, count),
                          expected_output("broadcast", ReduceOp::SUM, at::kFloat, rank, world, rank,
                                          count)),
              count / 2);
    const at::Tensor a2a =
        expected_output("alltoall", ReduceOp::SUM, at::kFloat, rank, world, 0, count);
    const at::Tensor a2a_other =
        expected_output("alltoall", ReduceOp::SUM, at::kFloat, other, world, 0, count);
    EXPECT_GT(count_wrong(a2a_other, a2a), a2a.numel() / 2);
  }
  // A result of the wrong size is wrong everywhere.
  const at::Tensor ar = expected_output("allreduce", ReduceOp::SUM, at::kFloat, 0, world, 0, 16);
  EXPECT_EQ(count_wrong(ar.narrow(0, 0, 15), ar), 16);
}

// Each rank's input is its own: no two ranks draw the same values, and the values are the small
// integers that keep every reduction exact.
TEST(BenchCheck, InputsDependOnTheRankAndStayExact) {
  const at::Tensor a = input_values(0, 1000), b = input_values(1, 1000);
  EXPECT_TRUE(at::equal(a, input_values(0, 1000)));  // every rank computes the same for rank 0
  EXPECT_GT(count_wrong(b, a), 500);
  EXPECT_GE(a.min().item<double>(), 1);
  EXPECT_LE(a.max().item<double>(), 5);
  EXPECT_TRUE(at::equal(a, a.round()));
}

}  // namespace
}  // namespace tdist::bench
