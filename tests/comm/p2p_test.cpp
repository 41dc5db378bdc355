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
      for (int tag = 1; tag <= 3; ++tag)
        EXPECT_TRUE(torch::equal(got[tag], torch::full({4}, tag * 1.0)));
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
    // No barrier at the end: rank 0 may destroy its group while its last eager messages are
    // still unread by rank 1 (Note [Losing a peer]).
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

// A receive waits only for its own (peer, tag): recv(tag 2) posted and waited for before
// recv(tag 1) completes although the sender sent tag 1 first, for small and for large messages,
// and messages of one tag still arrive in the order they were sent. Short group timeout: before
// the fix the first wait timed out.
TEST(P2P, ReceiveOfALaterTagDoesNotWaitForAnEarlierOne) {
  tdist::test::spawn(2, [](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 2, test::test_options(Millis(5000)));
    const int64_t big = 1 << 20;  // 4 MiB of float: far more than a socket buffer holds
    if (rank == 0) {
      std::vector<std::shared_ptr<Work>> works;
      works.push_back(pg->send(torch::full({4}, 1.0), 1, 1));
      works.push_back(pg->send(torch::full({4}, 2.0), 1, 2));
      works.push_back(pg->send(torch::full({big}, 3.0), 1, 3));
      works.push_back(pg->send(torch::full({big}, 4.0), 1, 4));
      // One tag, three messages, large between small ones: delivered in order.
      works.push_back(pg->send(torch::full({big}, 5.0), 1, 5));
      works.push_back(pg->send(torch::full({big}, 6.0), 1, 5));
      works.push_back(pg->send(torch::full({big}, 7.0), 1, 5));
      for (auto& w : works) w->wait();
    } else {
      auto two = torch::empty({4});
      pg->recv(two, 0, 2)->wait();
      auto one = torch::empty({4});
      pg->recv(one, 0, 1)->wait();
      EXPECT_TRUE(torch::equal(two, torch::full({4}, 2.0)));
      EXPECT_TRUE(torch::equal(one, torch::full({4}, 1.0)));
      auto four = torch::empty({big});
      pg->recv(four, 0, 4)->wait();
      auto three = torch::empty({big});
      pg->recv(three, 0, 3)->wait();
      EXPECT_TRUE(torch::equal(four, torch::full({big}, 4.0)));
      EXPECT_TRUE(torch::equal(three, torch::full({big}, 3.0)));
      for (double v : {5.0, 6.0, 7.0}) {
        auto t = torch::empty({big});
        pg->recv(t, 0, 5)->wait();
        EXPECT_TRUE(torch::equal(t, torch::full({big}, v))) << v;
      }
    }
    pg->barrier()->wait();
  });
}

// recv_any_source(tag) takes a message of that tag from whichever rank has one, even when that
// rank sent a message of another tag first; the other tag is received afterwards.
TEST(P2P, RecvAnySourceSkipsOverOtherTags) {
  tdist::test::spawn(3, [](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 3, test::test_options(Millis(5000)));
    if (rank == 0) {
      std::set<int> seen;
      for (int i = 0; i < 2; ++i) {
        auto t = torch::empty({3}, torch::kLong);
        auto w = pg->recv_any_source(t, 2);
        w->wait();
        const int src = w->source_rank();
        EXPECT_TRUE(torch::equal(t, torch::full({3}, int64_t(src * 10 + 2), torch::kLong)));
        seen.insert(src);
      }
      EXPECT_EQ(seen, (std::set<int>{1, 2}));
      auto t = torch::empty({3}, torch::kLong);
      auto w = pg->recv_any_source(t, 1);
      w->wait();
      EXPECT_EQ(w->source_rank(), 1);
      EXPECT_TRUE(torch::equal(t, torch::full({3}, int64_t(11), torch::kLong)));
    } else if (rank == 1) {
      auto a = pg->send(torch::full({3}, int64_t(11), torch::kLong), 0, 1);
      auto b = pg->send(torch::full({3}, int64_t(12), torch::kLong), 0, 2);
      a->wait();
      b->wait();
    } else {
      pg->send(torch::full({3}, int64_t(22), torch::kLong), 0, 2)->wait();
    }
    pg->barrier()->wait();
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
                  std::string::npos)
            << e.what();
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
