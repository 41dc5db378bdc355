// send / recv / recv_any_source between threads-as-ranks.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tests/comm/comm_test_util.h"

namespace tdist::comm {
namespace {

TEST(P2P, TagsMatchOutOfOrderAndLargeMessagesCross) {
  tdist::test::spawn(2, [](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 2, test::test_options());
    const int peer = 1 - rank;
    // Both ranks send 8 MiB to each other before receiving: sends must not block the receive.
    auto big_out = torch::full({2 << 20}, float(rank));
    auto big_in = torch::empty({2 << 20});
    auto s = pg->send(big_out, peer, 7);
    auto r = pg->recv(big_in, peer, 7);
    s->wait();
    r->wait();
    EXPECT_TRUE(torch::equal(big_in, torch::full({2 << 20}, float(peer))));
    // Rank 0 sends tags 1, 2, 3; rank 1 receives them as 3, 1, 2.
    if (rank == 0) {
      for (int tag = 1; tag <= 3; ++tag) pg->send(torch::full({4}, tag * 1.0), 1, tag)->wait();
    } else {
      std::vector<at::Tensor> got(4);
      std::vector<std::shared_ptr<Work>> works;
      for (int tag : {3, 1, 2}) {
        got[tag] = torch::empty({4});
        works.push_back(pg->recv(got[tag], 0, tag));
      }
      for (auto& w : works) w->wait();
      for (int tag = 1; tag <= 3; ++tag) EXPECT_TRUE(torch::equal(got[tag], torch::full({4}, tag * 1.0)));
    }
    // Empty and non-contiguous tensors.
    auto empty = torch::empty({0});
    if (rank == 0) {
      pg->send(empty, 1)->wait();
      pg->send(torch::arange(6, torch::kFloat).reshape({2, 3}).t(), 1)->wait();
    } else {
      pg->recv(empty, 0)->wait();
      auto dst = torch::zeros({2, 3}).t();
      pg->recv(dst, 0)->wait();
      EXPECT_TRUE(torch::equal(dst, torch::arange(6, torch::kFloat).reshape({2, 3}).t()));
    }
  });
}

TEST(P2P, RecvAnySourceReportsTheSender) {
  tdist::test::spawn(4, [](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 4, test::test_options());
    if (rank == 0) {
      std::set<int> seen;
      for (int i = 0; i < 3; ++i) {
        auto t = torch::empty({2}, torch::kLong);
        auto w = pg->recv_any_source(t, 5);
        w->wait();
        int src = w->source_rank();
        EXPECT_TRUE(torch::equal(t, torch::full({2}, int64_t(src), torch::kLong)));
        seen.insert(src);
      }
      EXPECT_EQ(seen, (std::set<int>{1, 2, 3}));
    } else {
      pg->send(torch::full({2}, int64_t(rank), torch::kLong), 0, 5)->wait();
    }
  });
}

TEST(P2P, SizeMismatchTimeoutAndBadArguments) {
  tdist::test::spawn(2, [](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 2, test::test_options());
    EXPECT_THROW(pg->send(torch::ones({1}), rank, 0), InvalidArgument);  // itself
    EXPECT_THROW(pg->send(torch::ones({1}), 2, 0), InvalidArgument);
    EXPECT_THROW(pg->recv(torch::ones({1}), -1, 0), InvalidArgument);
    EXPECT_THROW(pg->send(torch::ones({1}), 1 - rank, -3), InvalidArgument);
    if (rank == 0) {
      pg->send(torch::ones({5}), 1, 9)->wait();
      pg->send(torch::full({2}, 4.0), 1, 9)->wait();
    } else {
      auto wrong = torch::empty({3});
      try {
        pg->recv(wrong, 0, 9)->wait();
        ADD_FAILURE() << "size mismatch not detected";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("sent 20 bytes but the receive buffer holds 12"),
                  std::string::npos) << e.what();
      }
      // The stream stayed in step: the next message arrives intact.
      auto next = torch::empty({2});
      pg->recv(next, 0, 9)->wait();
      EXPECT_TRUE(torch::equal(next, torch::full({2}, 4.0)));
      // Nothing is sent with tag 11: the receive times out alone.
      SendRecvOptions o;
      o.timeout = Millis(200);
      try {
        pg->recv(torch::empty({1}), 0, 11, o)->wait();
        ADD_FAILURE() << "no timeout";
      } catch (const TimeoutError& e) {
        std::string msg = e.what();
        EXPECT_NE(msg.find("rank 1: recv from rank 0 (tag 11"), std::string::npos) << msg;
      }
    }
    pg->barrier()->wait();  // the group is still usable
  });
}

}  // namespace
}  // namespace tdist::comm
