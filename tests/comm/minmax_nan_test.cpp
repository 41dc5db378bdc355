// MIN / MAX with NaN and signed zeros: every algorithm that reduces (allreduce by ring and by
// recursive doubling, reduce along the chain, reduce-scatter around the ring) must follow
// torch.minimum / torch.maximum (a NaN in any input gives NaN) and leave bit-identical results on
// every rank, for every floating dtype, on world sizes 2, 3 and 4 (ranks as threads).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/comm/engine/reduce_kernels.h"
#include "tests/comm/comm_test_util.h"

namespace tdist::comm {
namespace {

constexpr int64_t kLen = 61;  // several 24-byte chunks per block on every world size

std::vector<c10::ScalarType> float_dtypes() {
  return {c10::ScalarType::Float, c10::ScalarType::Double, c10::ScalarType::Half,
          c10::ScalarType::BFloat16};
}

// Rank r: NaN where i % 5 == r (rank 4 of a world of 4 does not exist, so i % 5 == 4 has no
// NaN anywhere), +0.0 / -0.0 (by rank parity) where i % 7 == 3, small numbers elsewhere.
at::Tensor nan_input(c10::ScalarType t, int rank, int64_t n) {
  auto i = torch::arange(n, torch::kLong);
  auto v = ((i * 7 + rank * 13) % 11 - 5).to(torch::kDouble);
  v = torch::where(i % 7 == 3, torch::full({}, rank % 2 ? -0.0 : 0.0, torch::kDouble), v);
  v = torch::where(i % 5 == rank, torch::full({}, std::nan(""), torch::kDouble), v);
  return v.to(t);
}

at::Tensor torch_fold(const std::vector<at::Tensor>& inputs, ReduceOp op) {
  at::Tensor r = inputs[0];
  for (size_t k = 1; k < inputs.size(); ++k) {
    r = op == ReduceOp::MIN ? torch::minimum(r, inputs[k]) : torch::maximum(r, inputs[k]);
  }
  return r;
}

// Same NaN positions, equal numbers elsewhere (+0 == -0: torch's own kernels differ in which
// zero they keep, so only the cross-rank check below looks at bits).
::testing::AssertionResult matches_torch(const at::Tensor& got, const at::Tensor& want) {
  auto g = got.to(torch::kDouble);
  auto w = want.to(torch::kDouble);
  if (!torch::equal(g.isnan(), w.isnan())) {
    return ::testing::AssertionFailure() << "NaN positions differ: got " << test::describe(got)
                                         << " want " << test::describe(want);
  }
  auto mask = ~w.isnan();
  if (!torch::equal(g.masked_select(mask), w.masked_select(mask))) {
    return ::testing::AssertionFailure()
           << "values differ: got " << test::describe(got) << " want " << test::describe(want);
  }
  return ::testing::AssertionSuccess();
}

at::Tensor bits(const at::Tensor& t) {
  switch (t.element_size()) {
    case 2:
      return t.contiguous().view(torch::kShort);
    case 4:
      return t.contiguous().view(torch::kInt);
    default:
      return t.contiguous().view(torch::kLong);
  }
}

TEST(MinMaxNaN, KernelsPropagateNaNAndCommute) {
  for (auto t : float_dtypes()) {
    for (auto op : {ReduceOp::MIN, ReduceOp::MAX}) {
      SCOPED_TRACE(str(c10::toString(t), " ", to_string(op)));
      auto a = nan_input(t, 0, kLen);
      auto b = nan_input(t, 1, kLen);
      auto ab = torch::empty_like(a);
      auto ba = torch::empty_like(a);
      auto fn = detail::reduce_kernel(t, op);
      fn(ab.data_ptr(), a.data_ptr(), b.data_ptr(), kLen);
      fn(ba.data_ptr(), b.data_ptr(), a.data_ptr(), kLen);
      EXPECT_TRUE(matches_torch(ab, torch_fold({a, b}, op)));
      EXPECT_TRUE(torch::equal(bits(ab), bits(ba))) << "a op b and b op a differ in their bits";
    }
  }
}

// Runs `world` ranks with the given allreduce algorithm and checks allreduce, reduce (every root)
// and reduce_scatter_tensor for each float dtype and MIN / MAX.
void check_world(int world, const std::string& algo) {
  tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_ALLREDUCE_ALGO", algo},
                                                 {"TDIST_CHUNK_BYTES", std::string("24")}});
  std::vector<std::vector<at::Tensor>> results(world);
  tdist::test::spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, world, test::test_options(Millis(30000)));
    for (auto t : float_dtypes()) {
      for (auto op : {ReduceOp::MIN, ReduceOp::MAX}) {
        SCOPED_TRACE(
            str(algo, " world=", world, " rank=", rank, " ", c10::toString(t), " ", to_string(op)));
        std::vector<at::Tensor> all;
        for (int r = 0; r < world; ++r) all.push_back(nan_input(t, r, kLen));
        auto want = torch_fold(all, op);

        auto x = nan_input(t, rank, kLen);
        AllreduceOptions ao;
        ao.op = op;
        pg->allreduce(x, ao)->wait();
        EXPECT_TRUE(matches_torch(x, want)) << "allreduce";
        results[rank].push_back(bits(x));

        for (int root = 0; root < world; ++root) {
          auto y = nan_input(t, rank, kLen);
          ReduceOptions ro;
          ro.op = op;
          ro.root = root;
          pg->reduce(y, ro)->wait();
          if (rank == root) {
            EXPECT_TRUE(matches_torch(y, want)) << "reduce to root " << root;
          }
        }

        std::vector<at::Tensor> big;
        for (int r = 0; r < world; ++r) big.push_back(nan_input(t, r, kLen * world));
        auto big_want = torch_fold(big, op);
        auto out = torch::empty({kLen}, big[rank].options());
        ReduceScatterOptions so;
        so.op = op;
        pg->reduce_scatter_tensor(out, big[rank], so)->wait();
        EXPECT_TRUE(matches_torch(out, big_want.narrow(0, rank * kLen, kLen))) << "reduce_scatter";
      }
    }
  });
  for (int r = 1; r < world; ++r) {
    ASSERT_EQ(results[r].size(), results[0].size());
    for (size_t k = 0; k < results[0].size(); ++k) {
      EXPECT_TRUE(torch::equal(results[0][k], results[r][k]))
          << algo << " world " << world << " case " << k << ": rank " << r
          << " differs from rank 0 in its bits";
    }
  }
}

class MinMaxNaNTest : public ::testing::TestWithParam<int> {};

TEST_P(MinMaxNaNTest, RingPropagatesNaNBitIdentically) { check_world(GetParam(), "ring"); }

TEST_P(MinMaxNaNTest, RecursiveDoublingPropagatesNaNBitIdentically) {
  check_world(GetParam(), "recursive_doubling");
}

INSTANTIATE_TEST_SUITE_P(Worlds, MinMaxNaNTest, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace tdist::comm
