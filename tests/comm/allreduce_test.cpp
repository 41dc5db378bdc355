// allreduce (both algorithms) against the single-process reference, for every reduce op and
// dtype, on world sizes 1, 2, 3, 4 and 7 (ranks as threads), sizes 0, 1, odd and multi-chunk.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/comm/ring/ring_process_group.h"
#include "tests/comm/comm_test_util.h"

namespace tdist::comm {
namespace {

// Parameters: world size and transport ("auto": shared memory between the thread ranks,
// "tcp": loopback TCP).
class AllreduceTest : public ::testing::TestWithParam<std::tuple<int, const char*>> {
 protected:
  void SetUp() override {
    transport_ = std::make_unique<tdist::test::EnvGuard>(
        tdist::test::EnvVars{{"TDIST_TRANSPORT", std::string(std::get<1>(GetParam()))}});
  }
  int world() const { return std::get<0>(GetParam()); }
  std::unique_ptr<tdist::test::EnvGuard> transport_;
};

// `hosts`: rank r's host key is hosts[r] (Options::host); empty: the real one.
void check_every_op_and_dtype(int world, const std::string& algo, const std::string& hosts = "") {
  tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_ALLREDUCE_ALGO", algo},
                                                 {"TDIST_CHUNK_BYTES", std::string("24")}});
  tdist::test::spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    auto opts = test::test_options();
    if (!hosts.empty()) opts.host = std::string(1, hosts[rank]);
    auto pg = create_process_group(store, rank, world, opts);
    for (int64_t n : {0, 1, 13, 301}) {
      for (auto t : test::all_dtypes()) {
        for (auto op : test::all_ops()) {
          if (!test::op_supported(t, op)) continue;
          SCOPED_TRACE(str(algo, " n=", n, " ", c10::toString(t), " ", to_string(op)));
          auto x = test::make_input(t, op, n, rank);
          AllreduceOptions o;
          o.op = op;
          pg->allreduce(x, o)->wait();
          auto want = test::expected(t, op, n, world);
          ASSERT_TRUE(test::same(x, want)) << test::describe(x) << " vs " << test::describe(want);
        }
      }
    }
  });
}

TEST_P(AllreduceTest, RingEveryOpAndDtype) { check_every_op_and_dtype(world(), "ring"); }

TEST_P(AllreduceTest, RecursiveDoublingEveryOpAndDtype) {
  check_every_op_and_dtype(world(), "recursive_doubling");
}

// Halving-doubling (Note [Halving-doubling]) at worlds 2, 4 and 8 (where the automatic choice
// takes it) and at world 3, where a rank folds in; sizes 0, 1 (below the block count), odd and
// several blocks; every op (AVG divided once per block) and dtype.
TEST(AllreduceHalvingDoubling, EveryOpAndDtypeAtWorldsTwoThreeFourEight) {
  for (int world : {2, 3, 4, 8}) check_every_op_and_dtype(world, "halving_doubling");
}

// Default chunking: a float buffer of several 256 KiB chunks through the ring, and the results
// bit-identical on every rank.
TEST_P(AllreduceTest, LargeBufferDefaultChunks) {
  const int world = this->world();
  const int64_t n = 300007;
  std::vector<at::Tensor> results(world);
  tdist::test::spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, world, test::test_options());
    auto x = torch::randn({n}, torch::TensorOptions().dtype(torch::kFloat)) + rank;
    auto copy = x.clone();
    pg->allreduce(x)->wait();
    results[rank] = x;
    // the reference needs every rank's input: gather them
    std::vector<at::Tensor> inputs;
    for (int r = 0; r < world; ++r) inputs.push_back(torch::empty_like(copy));
    pg->allgather(inputs, copy)->wait();
    auto want = torch::stack(inputs).to(torch::kDouble).sum(0).to(torch::kFloat);
    EXPECT_TRUE(torch::allclose(x, want, 1e-4, 1e-4));
  });
  for (int r = 1; r < world; ++r) EXPECT_TRUE(torch::equal(results[0], results[r]));
}

// Many operations in flight before any wait, on tensors of different sizes and dtypes.
TEST_P(AllreduceTest, ManyOutstandingAsyncOps) {
  const int world = this->world();
  tdist::test::spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, world, test::test_options());
    std::vector<at::Tensor> xs;
    std::vector<std::shared_ptr<Work>> works;
    for (int i = 0; i < 64; ++i) {
      auto t = i % 2 ? torch::kFloat : torch::kLong;
      xs.push_back(test::make_input(t, ReduceOp::SUM, 1 + i * 97, rank, i));
      works.push_back(pg->allreduce(xs.back()));
    }
    for (int i = 63; i >= 0; --i) {
      works[i]->wait();
      EXPECT_EQ(works[i]->sequence_number(), static_cast<uint64_t>(i));
      auto t = i % 2 ? torch::kFloat : torch::kLong;
      EXPECT_TRUE(test::same(xs[i], test::expected(t, ReduceOp::SUM, 1 + i * 97, world, i)));
      EXPECT_TRUE(works[i]->is_success());
      EXPECT_TRUE(xs[i].is_same(works[i]->result()[0]));
    }
  });
}

TEST_P(AllreduceTest, CoalescedAndNonContiguous) {
  const int world = this->world();
  tdist::test::spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, world, test::test_options());
    auto a = torch::full({3, 4}, rank + 1.0);
    auto b = torch::full({5}, 2.0 * rank);
    AllreduceCoalescedOptions o;
    o.op = ReduceOp::MAX;
    pg->allreduce_coalesced({a, b}, o)->wait();
    EXPECT_TRUE(torch::equal(a, torch::full({3, 4}, double(world))));
    EXPECT_TRUE(torch::equal(b, torch::full({5}, 2.0 * (world - 1))));
    // A transposed view: reduced through a contiguous copy and written back.
    auto base = torch::arange(12, torch::kFloat).reshape({3, 4}) * (rank + 1);
    auto view = base.t();
    ASSERT_FALSE(view.is_contiguous());
    pg->allreduce(view)->wait();
    auto want = torch::arange(12, torch::kFloat).reshape({3, 4}) * (world * (world + 1) / 2);
    EXPECT_TRUE(torch::equal(base, want));
  });
}

// Note [Coalesced allreduce in place]: tensors from 32 KiB reduced where they lie, runs of
// smaller ones packed, a non-contiguous tensor (on one rank only) and a tensor given twice
// reduced in copies: the ranks' runs must match although their layouts differ.
TEST_P(AllreduceTest, CoalescedPlanIgnoresLayoutAndAliases) {
  const int world = this->world();
  tdist::test::spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, world, test::test_options());
    const double f = rank + 1.0;
    auto ramp = [&](int64_t n) { return torch::arange(n, torch::kFloat) * f; };
    auto small1 = ramp(3);
    auto small2 = ramp(1000).reshape({10, 100});
    auto big = ramp(128 * 128);  // 64 KiB
    auto odd = rank == 0 ? ramp(256 * 300).reshape({256, 300}).t().contiguous().t()
                         : ramp(256 * 300).reshape({256, 300});
    auto empty = torch::empty({0});
    auto tail = ramp(9000);  // 36 KiB
    std::vector<at::Tensor> list{small1, big, small2, empty, odd, big, tail};
    ASSERT_EQ(odd.is_contiguous(), rank != 0);
    const void* big_data = big.data_ptr();
    pg->allreduce_coalesced(list)->wait();
    const double sum = world * (world + 1) / 2.0;
    auto want = [&](int64_t n) { return torch::arange(n, torch::kFloat) * sum; };
    EXPECT_TRUE(torch::equal(small1, want(3)));
    EXPECT_TRUE(torch::equal(small2, want(1000).reshape({10, 100})));
    EXPECT_TRUE(torch::equal(big, want(128 * 128)));  // given twice: reduced once
    EXPECT_EQ(big.data_ptr(), big_data);
    EXPECT_TRUE(torch::equal(odd, want(256 * 300).reshape({256, 300})));
    EXPECT_EQ(odd.is_contiguous(), rank != 0);
    EXPECT_TRUE(torch::equal(tail, want(9000)));
  });
}

// A tiny shared-memory ring of odd capacity: every transfer wraps, elements straddle the wrap,
// writers fill the ring and wait for space, and incoming operands are misaligned in the ring.
TEST(AllreduceShm, TinyOddRingWrapsAndSplitsElements) {
  tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_SHM_BYTES", std::string("4099")},
                                                 {"TDIST_TRANSPORT", std::string("auto")},
                                                 {"TDIST_CHUNK_BYTES", std::string("1000")}});
  const int world = 3;
  tdist::test::spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    for (auto algo : {"ring", "recursive_doubling"}) {
      auto o = test::test_options();
      o.ring.allreduce_algo = algo;
      auto pg = create_process_group(store, rank, world, o);
      for (int64_t n : {1, 3, 257, 5001}) {
        for (auto t : {torch::kComplexDouble, torch::kFloat, torch::kHalf, torch::kUInt8}) {
          auto x = test::make_input(t, ReduceOp::SUM, n, rank);
          pg->allreduce(x)->wait();
          // A 3-byte broadcast between allreduces leaves the stream at odd offsets.
          auto odd = torch::full({3}, rank == 0 ? 7 : 0, torch::kUInt8);
          pg->broadcast(odd)->wait();
          ASSERT_TRUE(test::same(x, test::expected(t, ReduceOp::SUM, n, world))) << n << " " << t;
          ASSERT_TRUE(torch::equal(odd, torch::full({3}, 7, torch::kUInt8)));
        }
      }
    }
    // reduce_scatter and reduce over the same tiny rings.
    auto pg = create_process_group(store, rank, world, test::test_options());
    auto in = torch::arange(world * 2001, torch::kDouble) + rank;
    auto out = torch::empty({2001}, torch::kDouble);
    pg->reduce_scatter_tensor(out, in)->wait();
    auto want = (torch::arange(world * 2001, torch::kDouble) * world + world * (world - 1) / 2)
                    .narrow(0, rank * 2001, 2001);
    ASSERT_TRUE(torch::equal(out, want));
    auto y = torch::full({3001}, double(rank + 1));
    pg->reduce(y)->wait();
    if (rank == 0) {
      ASSERT_TRUE(torch::equal(y, torch::full({3001}, 6.0)));
    }
  });
}

// Ranks given host keys by a layout ("abab": ranks 0 and 2 on host a, 1 and 3 on host b), so that
// the hierarchical allreduce runs between thread ranks; the second parameter says whether the
// layout allows it (every host the same number of ranks, at least two, and two hosts or more).
class HierarchicalAllreduceTest : public ::testing::TestWithParam<std::tuple<const char*, bool>> {
 protected:
  std::string layout() const { return std::get<0>(GetParam()); }
  int world() const { return static_cast<int>(layout().size()); }
  bool expected() const { return std::get<1>(GetParam()); }
};

TEST_P(HierarchicalAllreduceTest, EveryOpAndDtype) {
  check_every_op_and_dtype(world(), "hierarchical", layout());
}

// Default chunking and the automatic choice: above the small size the hierarchy runs when the
// layout allows it; every rank ends with the same bits, close to the float64 sum.
TEST_P(HierarchicalAllreduceTest, AutoChoiceLargeBufferSameBitsEverywhere) {
  const int world = this->world();
  const int64_t n = 300007;
  std::vector<at::Tensor> results(world);
  tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_ALLREDUCE_ALGO", std::string("auto")}});
  tdist::test::spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    auto opts = test::test_options();
    opts.host = std::string(1, layout()[rank]);
    auto pg = create_process_group(store, rank, world, opts);
    auto* ring = dynamic_cast<detail::RingProcessGroup*>(pg.get());
    ASSERT_NE(ring, nullptr);
    const auto* h = ring->hierarchy();
    ASSERT_EQ(h != nullptr, expected());
    if (h) {
      EXPECT_EQ(static_cast<int>(h->local.size() * h->cross.size()), world);
      EXPECT_EQ(h->local[h->local_index], rank);
      EXPECT_EQ(h->cross[h->host_index], rank);
      for (int r : h->local) EXPECT_EQ(layout()[r], layout()[rank]);
    }
    torch::manual_seed(rank);
    auto x = torch::randn({n}, torch::kFloat);
    std::vector<at::Tensor> inputs;
    for (int r = 0; r < world; ++r) inputs.push_back(torch::empty_like(x));
    pg->allgather(inputs, x)->wait();
    pg->allreduce(x)->wait();
    results[rank] = x;
    auto want = torch::stack(inputs).to(torch::kDouble).sum(0).to(torch::kFloat);
    EXPECT_TRUE(torch::allclose(x, want, 1e-4, 1e-4));
  });
  for (int r = 1; r < world; ++r) EXPECT_TRUE(torch::equal(results[0], results[r])) << r;
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, HierarchicalAllreduceTest,
    ::testing::Values(std::make_tuple("aabb", true), std::make_tuple("abab", true),
                      std::make_tuple("aaabbb", true), std::make_tuple("abcabc", true),
                      std::make_tuple("aabbb", false), std::make_tuple("ab", false),
                      std::make_tuple("aaaa", false)));

TEST(HostKey, EmptyOrLongerThan255BytesIsRefused) {
  for (const std::string& bad : {std::string(), std::string(256, 'h')}) {
    tdist::test::spawn(2, [&](int rank, std::shared_ptr<Store> store) {
      auto opts = test::test_options(Millis(5000));
      opts.host = rank == 0 ? bad : std::string("ok");
      if (rank == 0) {
        EXPECT_THROW(create_process_group(store, rank, 2, opts), InvalidArgument);
      } else {
        // The peer's group fails at its deadline or when rank 0's connection closes.
        EXPECT_ANY_THROW(create_process_group(store, rank, 2, opts));
      }
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, AllreduceTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 7),
                                            ::testing::Values("auto", "tcp")));

}  // namespace
}  // namespace tdist::comm
