// The test-only group the ddp tests run on must itself be right.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/core/error.h"
#include "tests/ddp/ddp_test_util.h"

namespace tdist::test {
namespace {

TEST(FakeProcessGroup, Collectives) {
  run_ranks(3, [](int rank, std::shared_ptr<comm::ProcessGroup> pg) {
    auto t = torch::full({5}, rank + 1.0);
    pg->allreduce(t)->wait();
    EXPECT_TRUE(t.equal(torch::full({5}, 6.0)));
    comm::AllreduceOptions avg;
    avg.op = comm::ReduceOp::AVG;
    auto h = torch::full({3}, rank * 2.0, torch::kHalf);
    pg->allreduce(h, avg)->wait();
    EXPECT_TRUE(h.equal(torch::full({3}, 2.0, torch::kHalf)));
    auto b = torch::full({2}, static_cast<double>(rank));
    comm::BroadcastOptions bo;
    bo.root = 2;
    auto work = pg->broadcast(b, bo);
    work->wait();
    EXPECT_TRUE(b.equal(torch::full({2}, 2.0)));
    EXPECT_EQ(work->result().at(0).data_ptr(), b.data_ptr());
    std::vector<torch::Tensor> outs{torch::empty({1}), torch::empty({1}), torch::empty({1})};
    pg->allgather(outs, torch::full({1}, rank * 10.0))->wait();
    for (int r = 0; r < 3; ++r) EXPECT_EQ(outs[r].item<double>(), r * 10.0);
    pg->barrier()->wait();
    EXPECT_THROW(pg->send(t, 0), InvalidArgument);
  });
}

TEST(FakeProcessGroup, CompletesAsynchronously) {
  auto groups = make_fake_groups(2);
  auto t0 = torch::ones({1}), t1 = torch::ones({1});
  auto w0 = groups[0]->allreduce(t0);
  EXPECT_FALSE(w0->is_completed());  // rank 1 has not issued it yet
  auto w1 = groups[1]->allreduce(t1);
  w0->wait(std::chrono::seconds(5));
  w1->wait(std::chrono::seconds(5));
  EXPECT_EQ(t0.item<double>(), 2.0);
}

TEST(FakeProcessGroup, MissingRankTimesOutAndMismatchFails) {
  comm::ProcessGroup::Options o;
  o.timeout = std::chrono::milliseconds(100);
  auto groups = make_fake_groups(2, o);
  auto w = groups[0]->allreduce(torch::ones({1}));
  try {
    w->wait();
    ADD_FAILURE() << "expected a timeout";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("rank(s) 1"), std::string::npos) << e.what();
  }
  auto groups2 = make_fake_groups(2);
  auto a = groups2[0]->allreduce(torch::ones({1}));
  auto b = groups2[1]->broadcast(torch::ones({1}));
  EXPECT_THROW(a->wait(), Error);
  EXPECT_THROW(b->wait(), Error);
}

// The operations the fake group does not model are refused by name, on the caller's thread.
TEST(FakeProcessGroup, AnOperationItDoesNotModelIsRefusedByName) {
  auto groups = make_fake_groups(2);
  for (auto& [name, issue] : std::vector<std::pair<std::string, std::function<void()>>>{
           {"reduce_scatter_tensor",
            [&] { groups[0]->reduce_scatter_tensor(torch::zeros({2}), torch::zeros({4})); }},
           {"send", [&] { groups[0]->send(torch::zeros({2}), 1); }},
           {"new_group", [&] { groups[0]->new_group({0}); }}}) {
    try {
      issue();
      ADD_FAILURE() << name << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(name + " is not supported"), std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace tdist::test
