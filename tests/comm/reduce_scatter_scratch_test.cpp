// Ring reduce-scatter keeps its partial results in a bounded number of chunk-sized scratch slots:
// the scratch it asks for stays below a constant times the chunk size whatever the world size
// and the tensor size, on shared memory and on TCP, and the results stay right.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/comm/algorithms/reduce_scatter_ring.h"
#include "tests/comm/comm_test_util.h"

namespace tdist::comm {
namespace {

// Parameters: world size and transport.
class ReduceScatterScratch : public ::testing::TestWithParam<std::tuple<int, const char*>> {
 protected:
  int world() const { return std::get<0>(GetParam()); }
  std::string transport() const { return std::get<1>(GetParam()); }
};

// Per chunk size, block lengths from one element to many chunks per block.
void run_case(int world, const std::string& transport, size_t chunk_bytes,
              const std::vector<int64_t>& lengths) {
  tdist::test::EnvGuard env(tdist::test::EnvVars{
      {"TDIST_TRANSPORT", transport}, {"TDIST_CHUNK_BYTES", std::to_string(chunk_bytes)}});
  algorithms::reset_reduce_scatter_peak_scratch_bytes();
  tdist::test::spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, world, test::test_options(Millis(60000)));
    for (int64_t n : lengths) {
      for (auto t : {c10::ScalarType::Float, c10::ScalarType::Double}) {
        for (auto op : {ReduceOp::SUM, ReduceOp::MAX}) {
          SCOPED_TRACE(str("n=", n, " ", c10::toString(t), " ", to_string(op)));
          std::vector<at::Tensor> all;
          for (int r = 0; r < world; ++r) all.push_back(test::make_input(t, op, n * world, r));
          auto want = test::reference(all, op).narrow(0, rank * n, n);
          auto out = torch::empty({n}, all[rank].options());
          ReduceScatterOptions o;
          o.op = op;
          pg->reduce_scatter_tensor(out, all[rank], o)->wait();
          ASSERT_TRUE(test::same(out, want))
              << test::describe(out) << " vs " << test::describe(want);
          // The list form too (a separate input tensor per block).
          std::vector<at::Tensor> ins;
          for (int b = 0; b < world; ++b) ins.push_back(all[rank].narrow(0, b * n, n).clone());
          auto out2 = torch::empty({n}, all[rank].options());
          pg->reduce_scatter(out2, ins, o)->wait();
          ASSERT_TRUE(test::same(out2, want))
              << test::describe(out2) << " vs " << test::describe(want);
        }
      }
    }
  });
  const size_t peak = algorithms::reduce_scatter_peak_scratch_bytes();
  // A constant number of chunks, independent of the world size and of the block size (the
  // largest block here is hundreds of chunks).
  EXPECT_LE(peak, 8 * chunk_bytes) << "world " << world << ": reduce-scatter asked for " << peak
                                   << " bytes of scratch with " << chunk_bytes << "-byte chunks";
}

TEST_P(ReduceScatterScratch, SmallChunksScratchStaysBounded) {
  run_case(world(), transport(), 64, {1, 13, 1000});
}

TEST_P(ReduceScatterScratch, LargeBlocksScratchStaysBounded) {
  run_case(world(), transport(), 4096, {100003});
}

INSTANTIATE_TEST_SUITE_P(WorldsAndTransports, ReduceScatterScratch,
                         ::testing::Combine(::testing::Values(2, 3, 4, 7),
                                            ::testing::Values("auto", "tcp")),
                         [](const auto& info) {
                           return "world" + std::to_string(std::get<0>(info.param)) + "_" +
                                  std::string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace tdist::comm
