// Every collective but allreduce against single-process references, world sizes 1, 2, 3, 4, 7
// (threads), with a tiny chunk size so that small buffers take the multi-chunk paths.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/comm/ring/ring_process_group.h"
#include "tests/comm/comm_test_util.h"

namespace tdist::comm {
namespace {

// Parameters: world size and transport ("auto": shared memory, "tcp": loopback TCP,
// "single_copy": shared memory with single copies asked for from one byte, Note [Single-copy
// collectives]; the ranks here are threads of one process, which never read each other's
// memory, so they run the ring algorithms: tests/comm/process_test.cpp runs single copies).
class CollectivesTest : public ::testing::TestWithParam<std::tuple<int, const char*>> {
 protected:
  // Runs fn(rank, pg) on every rank with a small chunk size.
  template <typename F>
  void run(F fn, const char* chunk = "40") {
    const int world = this->world();
    const bool single_copy = transport() == "single_copy";
    tdist::test::EnvGuard env(tdist::test::EnvVars{
        {"TDIST_CHUNK_BYTES", std::string(chunk)},
        {"TDIST_TRANSPORT", single_copy ? std::string("auto") : transport()},
        {"TDIST_SINGLE_COPY", std::nullopt},
        {"TDIST_SINGLE_COPY_BYTES", single_copy ? std::optional<std::string>("1") : std::nullopt}});
    tdist::test::spawn(world, [&](int rank, std::shared_ptr<Store> store) {
      auto pg = create_process_group(store, rank, world, test::test_options());
      fn(rank, *pg);
    });
  }
  int world() const { return std::get<0>(GetParam()); }
  std::string transport() const { return std::get<1>(GetParam()); }
};

// No single copy between ranks of one process, whatever the transport or the threshold asked
// for (Note [Shared-memory negotiation]: the kernel names our own process at the other end).
TEST_P(CollectivesTest, RanksInOneProcessNeverUseSingleCopy) {
  run([&](int, ProcessGroup& pg) {
    auto* ring = dynamic_cast<detail::RingProcessGroup*>(&pg);
    ASSERT_NE(ring, nullptr);
    EXPECT_EQ(ring->single_copy_bytes(), detail::RingProcessGroup::kNoSingleCopy);
  });
}

const std::vector<c10::ScalarType> kSomeDtypes = {
    torch::kFloat, torch::kLong, torch::kHalf,          torch::kBFloat16,
    torch::kUInt8, torch::kBool, torch::kComplexDouble, torch::kDouble};

TEST_P(CollectivesTest, Broadcast) {
  run([&](int rank, ProcessGroup& pg) {
    for (int root = 0; root < world(); ++root) {
      for (int64_t n : {0, 1, 37, 1000}) {
        for (auto t : kSomeDtypes) {
          auto x =
              rank == root ? test::make_input(t, ReduceOp::SUM, n, root, 5) : torch::zeros({n}, t);
          BroadcastOptions o;
          o.root = root;
          pg.broadcast(x, o)->wait();
          ASSERT_TRUE(test::same(x, test::make_input(t, ReduceOp::SUM, n, root, 5)));
        }
      }
    }
  });
}

TEST_P(CollectivesTest, ReduceEveryOp) {
  run([&](int rank, ProcessGroup& pg) {
    for (int root = 0; root < world(); ++root) {
      for (int64_t n : {0, 1, 37, 300}) {
        for (auto t : {torch::kFloat, torch::kInt, torch::kHalf, torch::kBool}) {
          for (auto op : test::all_ops()) {
            if (!test::op_supported(t, op)) continue;
            auto x = test::make_input(t, op, n, rank);
            auto before = x.clone();
            ReduceOptions o;
            o.root = root;
            o.op = op;
            pg.reduce(x, o)->wait();
            if (rank == root) {
              std::vector<at::Tensor> all;
              for (int r = 0; r < world(); ++r) all.push_back(test::make_input(t, op, n, r));
              ASSERT_TRUE(test::same(x, test::reference(all, op))) << to_string(op);
            } else {
              ASSERT_TRUE(test::same(x, before)) << "non-root input changed";
            }
          }
        }
      }
    }
  });
}

TEST_P(CollectivesTest, AllgatherListAndFlat) {
  run([&](int rank, ProcessGroup& pg) {
    for (int64_t n : {0, 1, 37, 1000}) {
      for (auto t : kSomeDtypes) {
        auto in = test::make_input(t, ReduceOp::SUM, n, rank);
        std::vector<at::Tensor> outs;
        for (int r = 0; r < world(); ++r) outs.push_back(torch::empty({n}, t));
        pg.allgather(outs, in)->wait();
        auto flat = torch::empty({world() * n}, t);
        pg.allgather_into_tensor(flat, in)->wait();
        // In place: the input is this rank's block of the output.
        auto in_place = torch::empty({world() * n}, t);
        in_place.narrow(0, rank * n, n).copy_(in);
        pg.allgather_into_tensor(in_place, in_place.narrow(0, rank * n, n))->wait();
        for (int r = 0; r < world(); ++r) {
          auto want = test::make_input(t, ReduceOp::SUM, n, r);
          ASSERT_TRUE(test::same(outs[r], want));
          ASSERT_TRUE(test::same(flat.narrow(0, r * n, n), want));
          ASSERT_TRUE(test::same(in_place.narrow(0, r * n, n), want));
        }
      }
    }
  });
}

TEST_P(CollectivesTest, GatherAndScatter) {
  run([&](int rank, ProcessGroup& pg) {
    for (int root = 0; root < world(); ++root) {
      for (int64_t n : {0, 1, 37, 1000}) {
        auto in = test::make_input(torch::kFloat, ReduceOp::SUM, n, rank, root);
        std::vector<at::Tensor> outs;
        if (rank == root) {
          for (int r = 0; r < world(); ++r) outs.push_back(torch::empty({n}));
        }
        GatherOptions g;
        g.root = root;
        pg.gather(outs, in, g)->wait();
        for (size_t r = 0; r < outs.size(); ++r) {
          ASSERT_TRUE(
              test::same(outs[r], test::make_input(torch::kFloat, ReduceOp::SUM, n, r, root)));
        }
        std::vector<at::Tensor> ins;
        if (rank == root) {
          for (int r = 0; r < world(); ++r) ins.push_back(torch::full({n}, r * 10.0 + root));
        }
        auto out = torch::empty({n});
        ScatterOptions s;
        s.root = root;
        pg.scatter(out, ins, s)->wait();
        ASSERT_TRUE(torch::equal(out, torch::full({n}, rank * 10.0 + root)));
      }
    }
  });
}

TEST_P(CollectivesTest, ReduceScatterListAndFlatEveryOp) {
  run([&](int rank, ProcessGroup& pg) {
    for (int64_t n : {0, 1, 37, 300}) {
      for (auto t :
           {torch::kFloat, torch::kLong, torch::kBFloat16, torch::kBool, torch::kComplexFloat}) {
        for (auto op : test::all_ops()) {
          if (!test::op_supported(t, op)) continue;
          // Rank r's block i is input(seed = i).
          std::vector<at::Tensor> ins;
          for (int i = 0; i < world(); ++i) ins.push_back(test::make_input(t, op, n, rank, i));
          auto flat_in = torch::cat(ins);
          auto out = torch::empty({n}, t);
          auto flat_out = torch::empty({n}, t);
          ReduceScatterOptions o;
          o.op = op;
          pg.reduce_scatter(out, ins, o)->wait();
          pg.reduce_scatter_tensor(flat_out, flat_in, o)->wait();
          std::vector<at::Tensor> all;
          for (int r = 0; r < world(); ++r) all.push_back(test::make_input(t, op, n, r, rank));
          auto want = test::reference(all, op);
          ASSERT_TRUE(test::same(out, want)) << to_string(op) << " " << c10::toString(t);
          ASSERT_TRUE(test::same(flat_out, want)) << to_string(op) << " " << c10::toString(t);
          // Inputs are untouched.
          ASSERT_TRUE(test::same(ins[0], test::make_input(t, op, n, rank, 0)));
        }
      }
    }
  });
}

TEST_P(CollectivesTest, AlltoallEqualSplitsAndLists) {
  run([&](int rank, ProcessGroup& pg) {
    const int w = world();
    for (int64_t rows : {0, 1, 5}) {
      // Row j of the block for rank d holds 100*rank + 10*d + j.
      auto in = torch::empty({w * rows, 3});
      for (int d = 0; d < w; ++d) {
        for (int64_t j = 0; j < rows; ++j) in[d * rows + j].fill_(100.0 * rank + 10.0 * d + j);
      }
      auto out = torch::empty({w * rows, 3});
      pg.alltoall_base(out, in, {}, {})->wait();
      for (int s = 0; s < w; ++s) {
        for (int64_t j = 0; j < rows; ++j) {
          ASSERT_TRUE(
              torch::equal(out[s * rows + j], torch::full({3}, 100.0 * s + 10.0 * rank + j)));
        }
      }
      std::vector<at::Tensor> ins, outs;
      for (int d = 0; d < w; ++d) {
        ins.push_back(torch::full({rows + d}, 100.0 * rank + d, torch::kLong));
        outs.push_back(torch::empty({rows + rank}, torch::kLong));
      }
      pg.alltoall(outs, ins)->wait();
      for (int s = 0; s < w; ++s) {
        ASSERT_TRUE(
            torch::equal(outs[s], torch::full({rows + rank}, 100.0 * s + rank, torch::kLong)));
      }
    }
  });
}

TEST_P(CollectivesTest, AlltoallWithSplits) {
  run([&](int rank, ProcessGroup& pg) {
    const int w = world();
    // Rank s sends (s + d) % 3 rows to rank d, each row filled with 10*s + d.
    std::vector<int64_t> in_splits, out_splits;
    int64_t in_rows = 0, out_rows = 0;
    for (int d = 0; d < w; ++d) {
      in_splits.push_back((rank + d) % 3);
      out_splits.push_back((d + rank) % 3);
      in_rows += in_splits.back();
      out_rows += out_splits.back();
    }
    auto in = torch::empty({in_rows, 2}, torch::kInt);
    int64_t off = 0;
    for (int d = 0; d < w; ++d) {
      in.narrow(0, off, in_splits[d]).fill_(10 * rank + d);
      off += in_splits[d];
    }
    auto out = torch::empty({out_rows, 2}, torch::kInt);
    pg.alltoall_base(out, in, out_splits, in_splits)->wait();
    off = 0;
    for (int s = 0; s < w; ++s) {
      auto block = out.narrow(0, off, out_splits[s]);
      ASSERT_TRUE(torch::equal(block, torch::full_like(block, 10 * s + rank)));
      off += out_splits[s];
    }
  });
}

TEST_P(CollectivesTest, BarrierAndSequenceNumbers) {
  run([&](int, ProcessGroup& pg) {
    for (uint64_t i = 0; i < 20; ++i) {
      auto w = pg.barrier();
      w->wait();
      EXPECT_EQ(w->sequence_number(), i);
      EXPECT_EQ(w->op(), "barrier");
    }
  });
}

TEST_P(CollectivesTest, NewGroupHasItsOwnSequenceAndConnections) {
  run([&](int rank, ProcessGroup& pg) {
    const int w = world();
    std::vector<int> odd;
    for (int r = w - 1; r >= 0; --r) {
      if (r % 2 == 1) odd.push_back(r);  // unsorted on purpose
    }
    if (odd.empty()) odd.push_back(0);
    pg.barrier()->wait();
    auto sub = pg.new_group(odd);
    bool member = std::find(odd.begin(), odd.end(), rank) != odd.end();
    ASSERT_EQ(sub != nullptr, member);
    // Interleave parent and subgroup operations.
    auto x = torch::ones({7});
    auto pw = pg.allreduce(x);
    if (sub) {
      EXPECT_EQ(sub->size(), static_cast<int>(odd.size()));
      auto y = torch::full({5}, double(rank));
      auto sw = sub->allreduce(y);
      sw->wait();
      EXPECT_EQ(sw->sequence_number(), 0u);
      double sum = 0;
      for (int r : odd) sum += r;
      EXPECT_TRUE(torch::equal(y, torch::full({5}, sum)));
      sub->barrier()->wait();
    }
    pw->wait();
    EXPECT_EQ(pw->sequence_number(), 1u);
    EXPECT_TRUE(torch::equal(x, torch::full({7}, double(w))));
    // A second subgroup of everyone.
    std::vector<int> all;
    for (int r = 0; r < w; ++r) all.push_back(r);
    auto sub2 = pg.new_group(all);
    ASSERT_NE(sub2, nullptr);
    EXPECT_EQ(sub2->rank(), rank);
    sub2->barrier()->wait();
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, CollectivesTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 7),
                                            ::testing::Values("auto", "tcp", "single_copy")));

}  // namespace
}  // namespace tdist::comm
