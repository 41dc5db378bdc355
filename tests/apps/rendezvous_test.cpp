// ElasticRendezvous (Note [Elastic rendezvous]) driven in-process: each "node" is a thread with
// its own client of one real TCPStore server on loopback, so every step of the protocol (rounds,
// dense ranks, heartbeats, joins, restarts, finishing) is checked without launchers or workers.
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <memory>
#include <set>
#include <thread>

#include "apps/run/rendezvous.h"
#include "tdist/core/error.h"
#include "tdist/core/tcp_store.h"

namespace tdist::run {
namespace {

using std::chrono::milliseconds;

class ElasticRendezvousTest : public ::testing::Test {
 protected:
  TCPStoreServer server_{"127.0.0.1", 0};
  std::atomic<int> next_port_{40000};

  // A node as a launcher builds it: its own store client, a distinct address.
  std::unique_ptr<ElasticRendezvous> node(int min, int max, const std::string& addr,
                                          milliseconds keep_alive_timeout = milliseconds(1000)) {
    RendezvousConfig c;
    c.run_id = "unit";
    c.min_nodes = min;
    c.max_nodes = max;
    c.local_addr = addr;
    c.last_call = milliseconds(300);
    c.join_timeout = milliseconds(20000);
    c.keep_alive_interval = milliseconds(50);
    c.keep_alive_timeout = keep_alive_timeout;
    c.poll_interval = milliseconds(10);
    c.pick_master_port = [this] { return next_port_++; };
    auto store = std::make_shared<TCPStore>("127.0.0.1", server_.port());
    return std::make_unique<ElasticRendezvous>(store, c);
  }
};

// Every node of `nodes` calls next_round() on its own thread; the rounds they got, in order.
std::vector<std::optional<RoundInfo>> meet(const std::vector<ElasticRendezvous*>& nodes) {
  std::vector<std::future<std::optional<RoundInfo>>> f;
  for (auto* n : nodes)
    f.push_back(std::async(std::launch::async, [n] { return n->next_round(); }));
  std::vector<std::optional<RoundInfo>> out;
  for (auto& x : f) out.push_back(x.get());
  return out;
}

// Polls `n` until the round ends (or `limit` passes: nullopt).
std::optional<RoundEndInfo> poll_until_end(ElasticRendezvous& n, milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < until) {
    if (auto e = n.poll()) return e;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return std::nullopt;
}

TEST_F(ElasticRendezvousTest, ARoundHasDenseRanksOneMasterAndAFreshPortEachRound) {
  auto a = node(2, 3, "10.0.0.1"), b = node(2, 3, "10.0.0.2"), c = node(2, 3, "10.0.0.3");
  auto r = meet({a.get(), b.get(), c.get()});
  std::set<int> ranks;
  for (auto& x : r) {
    ASSERT_TRUE(x.has_value());
    EXPECT_EQ(x->round, 0);
    EXPECT_EQ(x->num_nodes, 3);
    EXPECT_EQ(x->failures, 0);
    EXPECT_EQ(x->master_addr, x->node_addrs[0]);
    EXPECT_EQ(x->master_port, r[0]->master_port) << "one master port per round";
    EXPECT_EQ(x->node_addrs, r[0]->node_addrs) << "every member sees the same membership";
    ranks.insert(x->node_rank);
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2}));
  // A failure ends the round for everyone; the next round has a new port and counts it.
  const auto end = a->end_round(RoundEnd::kFailure, "rank 0 exited with code 1");
  EXPECT_EQ(end.kind, RoundEnd::kFailure);
  EXPECT_EQ(end.reason, "rank 0 exited with code 1");
  for (auto* n : {b.get(), c.get()}) {
    auto seen = n->poll();
    ASSERT_TRUE(seen.has_value()) << "the others see the end at their next poll";
    EXPECT_EQ(seen->kind, RoundEnd::kFailure);
    EXPECT_EQ(seen->reason, end.reason);
  }
  for (auto* n : {a.get(), b.get(), c.get()}) n->register_next();
  auto again = meet({a.get(), b.get(), c.get()});
  for (size_t i = 0; i < again.size(); ++i) {
    ASSERT_TRUE(again[i].has_value());
    EXPECT_EQ(again[i]->round, 1);
    EXPECT_EQ(again[i]->failures, 1);
    EXPECT_EQ(again[i]->node_rank, r[i]->node_rank) << "survivors keep their order";
    EXPECT_NE(again[i]->master_port, r[i]->master_port) << "a fresh port per round";
  }
}

TEST_F(ElasticRendezvousTest, ASilentNodeIsDeadAndTheSurvivorsKeepTheirOrder) {
  auto a = node(2, 3, "10.0.0.1"), b = node(2, 3, "10.0.0.2"), c = node(2, 3, "10.0.0.3");
  auto r = meet({a.get(), b.get(), c.get()});
  ElasticRendezvous* by_rank[3];
  for (auto* n : {a.get(), b.get(), c.get()}) by_rank[n->current().node_rank] = n;
  // Rank 1 stops heartbeating (its launcher died); ranks 0 and 2 keep polling.
  auto end0 = std::async(std::launch::async,
                         [&] { return poll_until_end(*by_rank[0], milliseconds(8000)); });
  auto end2 = poll_until_end(*by_rank[2], milliseconds(8000));
  auto e0 = end0.get();
  ASSERT_TRUE(e0 && end2);
  EXPECT_EQ(e0->kind, RoundEnd::kFailure);
  EXPECT_EQ(e0->reason, end2->reason) << "the round ends once, with one reason";
  EXPECT_NE(e0->reason.find("node 1 (" + r[0]->node_addrs[1] + ") sent no heartbeat"),
            std::string::npos)
      << e0->reason;
  by_rank[0]->register_next();
  by_rank[2]->register_next();
  auto next = meet({by_rank[0], by_rank[2]});
  ASSERT_TRUE(next[0] && next[1]);
  EXPECT_EQ(next[0]->num_nodes, 2);
  EXPECT_EQ(next[0]->node_rank, 0) << "rank 0 stays rank 0 while it lives";
  EXPECT_EQ(next[1]->node_rank, 1) << "ranks stay dense: old rank 2 becomes 1";
  EXPECT_EQ(next[0]->master_addr, r[0]->node_addrs[0]);
}

TEST_F(ElasticRendezvousTest, AJoinEndsTheRoundWithoutCountingAsARestartAndComesLast) {
  auto a = node(2, 3, "10.0.0.1"), b = node(2, 3, "10.0.0.2");
  auto r = meet({a.get(), b.get()});
  ASSERT_TRUE(r[0] && r[1]);
  auto d = node(2, 3, "10.0.0.4");
  auto joined = std::async(std::launch::async, [&] { return d->next_round(); });
  auto ea = poll_until_end(*a, milliseconds(8000));
  ASSERT_TRUE(ea.has_value());
  EXPECT_EQ(ea->kind, RoundEnd::kMembershipChange);
  EXPECT_NE(ea->reason.find("waiting to join"), std::string::npos) << ea->reason;
  auto eb = poll_until_end(*b, milliseconds(8000));
  ASSERT_TRUE(eb.has_value());
  a->register_next();
  b->register_next();
  auto next = meet({a.get(), b.get()});
  auto rd = joined.get();
  ASSERT_TRUE(next[0] && next[1] && rd);
  EXPECT_EQ(rd->num_nodes, 3);
  EXPECT_EQ(rd->node_rank, 2) << "the newcomer comes after the survivors";
  EXPECT_EQ(rd->node_addrs[2], "10.0.0.4");
  EXPECT_EQ(rd->failures, 0) << "a join is not a restart";
  EXPECT_EQ(next[0]->node_rank, r[0]->node_rank);
  EXPECT_EQ(next[1]->node_rank, r[1]->node_rank);
}

TEST_F(ElasticRendezvousTest, ANodeBeyondMaxWaitsAndLeavesWhenTheJobIsDone) {
  auto a = node(1, 2, "10.0.0.1"), b = node(1, 2, "10.0.0.2");
  auto r = meet({a.get(), b.get()});
  ASSERT_TRUE(r[0] && r[1]);
  EXPECT_EQ(r[0]->num_nodes, 2);
  auto c = node(1, 2, "10.0.0.3");
  auto extra = std::async(std::launch::async, [&] { return c->next_round(); });
  // A full round is not ended by a waiting node.
  EXPECT_FALSE(poll_until_end(*a, milliseconds(500)).has_value());
  a->finish();
  b->finish();
  std::string why_a, why_b;
  EXPECT_TRUE(a->wait_finished(&why_a)) << why_a;
  EXPECT_TRUE(b->wait_finished(&why_b)) << why_b;
  EXPECT_FALSE(extra.get().has_value()) << "the job finished without the waiting node";
  a->leave();
  b->leave();
  a->wait_all_left(milliseconds(2000));
}

TEST_F(ElasticRendezvousTest, TooFewNodesTimeOutAndBadSettingsAreRefused) {
  RendezvousConfig c;
  c.local_addr = "10.0.0.1";
  c.pick_master_port = [] { return 1; };
  c.min_nodes = 3;
  c.max_nodes = 2;
  auto store = std::make_shared<TCPStore>("127.0.0.1", server_.port());
  EXPECT_THROW(ElasticRendezvous(store, c), InvalidArgument);
  c.min_nodes = 1;
  c.local_addr = "";
  EXPECT_THROW(ElasticRendezvous(store, c), InvalidArgument);

  c.min_nodes = 2;
  c.max_nodes = 2;
  c.local_addr = "10.0.0.1";
  c.join_timeout = milliseconds(500);
  c.poll_interval = milliseconds(10);
  ElasticRendezvous alone(store, c);
  EXPECT_THROW(alone.next_round(), TimeoutError);
}

}  // namespace
}  // namespace tdist::run
