// Conjugate views (x.conj() of a complex tensor) and negative views (x._neg_view()) carry a bit
// over the unchanged storage: collectives and send/recv must move the values the view shows, and
// write into such a view so that it shows the received values.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tests/comm/comm_test_util.h"

namespace tdist::comm {
namespace {

at::Tensor complex_input(int rank) {
  auto re = torch::arange(6, torch::kDouble) + rank * 10;
  auto im = torch::arange(6, torch::kDouble) * 0.5 + 1 + rank;
  return torch::complex(re, im).to(torch::kComplexFloat);
}

TEST(TensorViews, CollectivesMoveConjugateAndNegativeViewsAsTheirValues) {
  const int world = 3;
  tdist::test::spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, world, test::test_options(Millis(30000)));
    const auto mine = complex_input(rank);
    const auto want0 = complex_input(0).conj().resolve_conj();
    ASSERT_TRUE(mine.conj().is_conj());

    // broadcast: the root sends its conjugate view; rank 1 receives into a plain tensor, rank 2
    // into a conjugate view (which must then show the root's values).
    {
      at::Tensor t = rank == 0   ? mine.clone().conj()
                     : rank == 1 ? torch::zeros_like(mine)
                                 : torch::zeros_like(mine).conj();
      pg->broadcast(t)->wait();
      EXPECT_TRUE(torch::equal(t.resolve_conj(), want0)) << "broadcast on rank " << rank;
    }
    // allgather of a conjugate view into plain outputs.
    {
      std::vector<at::Tensor> outs;
      for (int r = 0; r < world; ++r) outs.push_back(torch::zeros_like(mine));
      pg->allgather(outs, mine.conj())->wait();
      for (int r = 0; r < world; ++r) {
        EXPECT_TRUE(torch::equal(outs[r], complex_input(r).conj().resolve_conj()))
            << "allgather block " << r << " on rank " << rank;
      }
    }
    // allreduce in place on a conjugate view: the view shows the sum of the conjugates.
    {
      auto t = mine.clone().conj();
      pg->allreduce(t)->wait();
      auto want = torch::zeros_like(mine);
      for (int r = 0; r < world; ++r) want += complex_input(r).conj();
      EXPECT_TRUE(torch::allclose(t.resolve_conj(), want)) << "allreduce on rank " << rank;
    }
    // send / recv of a conjugate view, and into one.
    if (rank == 0) {
      pg->send(mine.conj(), 1, 3)->wait();
      pg->send(mine, 2, 3)->wait();
    } else if (rank == 1) {
      auto t = torch::zeros_like(mine);
      pg->recv(t, 0, 3)->wait();
      EXPECT_TRUE(torch::equal(t, want0)) << "recv of a conjugate view";
    } else {
      auto t = torch::zeros_like(mine).conj();
      pg->recv(t, 0, 3)->wait();
      EXPECT_TRUE(torch::equal(t.resolve_conj(), complex_input(0))) << "recv into a conjugate view";
    }
    // A negative view of a real tensor.
    {
      auto x = torch::arange(5, torch::kFloat) + 1;
      at::Tensor t = rank == 0 ? x.clone()._neg_view() : torch::zeros({5});
      ASSERT_TRUE(rank != 0 || t.is_neg());
      pg->broadcast(t)->wait();
      EXPECT_TRUE(torch::equal(t.resolve_neg(), -x))
          << "broadcast of a negative view on rank " << rank;
    }
    pg->barrier()->wait();
  });
}

}  // namespace
}  // namespace tdist::comm
