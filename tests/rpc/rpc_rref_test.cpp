// remote() and RRefs: values, methods, forks across workers, lifetimes checked with a destructor
// counter, idempotent control messages, leaks reported at shutdown.
#include <gtest/gtest.h>

#include "tests/rpc/rpc_test_util.h"

namespace tdist::rpc::test {
namespace {

class RRefTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::set_num_threads(1);
    RpcOptions o;
    o.rpc_timeout = 30s;
    a_ = start_agents(3, o);
    baseline_live_ = Tracked::live.load();
    baseline_destroyed_ = Tracked::destroyed.load();
  }
  void TearDown() override {
    if (!a_.agents.empty()) shutdown_all(a_);
  }
  int64_t live() const { return Tracked::live.load() - baseline_live_; }
  int64_t destroyed() const { return Tracked::destroyed.load() - baseline_destroyed_; }

  Agents a_;
  int64_t baseline_live_ = 0;
  int64_t baseline_destroyed_ = 0;
};

TEST_F(RRefTest, RemoteConstructorMethodsAndToHere) {
  RRef<Tracked> r = a_[0]->remote<Tracked>("w1", "Tracked", int64_t{7});
  EXPECT_FALSE(r.is_owner());
  EXPECT_EQ(r.owner(), 1);
  EXPECT_EQ(r.owner_name(), "w1");
  EXPECT_EQ(r.to_here().id(), 7);
  EXPECT_TRUE(eventually([&] { return r.confirmed_by_owner(); }));
  EXPECT_EQ(r.rpc_sync<int64_t>("id"), 7);
  EXPECT_EQ(r.rpc_async<int64_t>("add", int64_t{3}).value(), 10);
  RRef<int64_t> sum = r.remote<int64_t>("add", int64_t{5});
  EXPECT_EQ(sum.owner(), 1);
  EXPECT_EQ(sum.to_here(), 15);
  EXPECT_EQ(live(), 1);
  EXPECT_THROW(r.local_value(), InvalidArgument);
  r = RRef<Tracked>();
  sum = RRef<int64_t>();
  EXPECT_TRUE(eventually([&] { return live() == 0; }));
  EXPECT_EQ(destroyed(), 1);
  ASSERT_TRUE(quiet(a_));
  EXPECT_EQ(a_[1]->rref_context().num_owned(), 0u);
}

TEST_F(RRefTest, RemoteFunctionsAndTensors) {
  auto x = torch::rand({64, 64});
  RRef<at::Tensor> t = a_[0]->remote<at::Tensor>("w2", "scale", x, 3.0);
  EXPECT_TRUE(torch::allclose(t.to_here(), x * 3));
  RRef<int64_t> s = a_[0]->remote<int64_t>(2, "add", int64_t{1}, int64_t{2});
  EXPECT_EQ(s.to_here(5s), 3);
  // A registered class without serialization (or copies) works through methods only
  // (to_here() on it does not compile).
  RRef<Counter> c = a_[0]->remote<Counter>("w1", "Counter", int64_t{100});
  std::vector<Future<int64_t>> fs;
  for (int i = 0; i < 50; ++i) fs.push_back(c.rpc_async<int64_t>("add", int64_t{1}));
  for (auto& f : fs) f.wait();
  EXPECT_EQ(c.rpc_sync<int64_t>("get"), 150);
  EXPECT_EQ(c.rpc_sync<int64_t>("add_twice", int64_t{5}), 160);
  try {
    c.rpc_sync<int64_t>("no_such_method");
    FAIL();
  } catch (const RemoteError& e) {
    EXPECT_NE(e.remote_message().find("unknown method 'no_such_method'"), std::string::npos)
        << e.what();
  }
}

TEST_F(RRefTest, RemoteErrorsReachToHere) {
  RRef<int64_t> bad = a_[0]->remote<int64_t>("w1", "throws", std::string("in remote"));
  try {
    bad.to_here();
    FAIL();
  } catch (const RemoteError& e) {
    EXPECT_NE(std::string(e.what()).find("boom: in remote"), std::string::npos) << e.what();
    EXPECT_EQ(e.worker(), "w1");
  }
  RRef<int64_t> unknown = a_[0]->remote<int64_t>("w1", "no_such_function");
  EXPECT_THROW(unknown.to_here(), RemoteError);
  // The owner still registered (and so frees) both.
  EXPECT_TRUE(eventually([&] { return bad.confirmed_by_owner() && unknown.confirmed_by_owner(); }));
  bad = RRef<int64_t>();
  unknown = RRef<int64_t>();
  ASSERT_TRUE(quiet(a_));
  EXPECT_EQ(a_[1]->rref_context().num_owned(), 0u);
}

TEST_F(RRefTest, RemoteToSelfAndLocalRRefs) {
  RRef<Tracked> own = a_[0]->remote<Tracked>("w0", "Tracked", int64_t{3});
  EXPECT_TRUE(own.is_owner());
  EXPECT_TRUE(own.confirmed_by_owner());
  EXPECT_EQ(own.local_value()->id(), 3);
  EXPECT_EQ(own.to_here().id(), 3);
  EXPECT_EQ(own.rpc_sync<int64_t>("add", int64_t{1}), 4);

  // An RRef to a local value, passed to other workers and back to its owner.
  RRef<Tracked> local = make_rref(a_[0], Tracked(5));
  EXPECT_TRUE(local.is_owner());
  EXPECT_EQ(a_[0]->rpc_sync<int64_t>("w1", "rref_id_of", local), 5);
  EXPECT_EQ(a_[0]->rpc_sync<int64_t>("w2", "rref_fetch", local), 5);
  EXPECT_TRUE(a_[0]->rpc_sync<bool>("w0", "rref_is_owner", local));
  EXPECT_FALSE(a_[0]->rpc_sync<bool>("w1", "rref_is_owner", local));
  EXPECT_EQ(live(), 2);
  own = RRef<Tracked>();
  local = RRef<Tracked>();
  EXPECT_TRUE(eventually([&] { return live() == 0; }));
  EXPECT_EQ(destroyed(), 2);
  ASSERT_TRUE(quiet(a_));
  EXPECT_EQ(a_[0]->rref_context().num_owned(), 0u);
}

TEST_F(RRefTest, RRefsAsResultsAndInContainers) {
  // The owner returns an RRef to its local value (owner -> user fork).
  RRef<Tracked> r = a_[0]->rpc_sync<RRef<Tracked>>("w1", "local_rref", int64_t{9});
  EXPECT_EQ(r.owner(), 1);
  EXPECT_TRUE(r.confirmed_by_owner());
  EXPECT_EQ(r.to_here().id(), 9);
  // User -> user -> back: w0 sends its fork to w2, which returns it.
  RRef<Tracked> back = a_[0]->rpc_sync<RRef<Tracked>>("w2", "return_rref", r);
  EXPECT_EQ(back.owner(), 1);
  EXPECT_NE(back.impl(), r.impl());  // a new fork
  EXPECT_EQ(back.rpc_sync<int64_t>("id"), 9);
  RRef<Tracked> other = a_[0]->remote<Tracked>("w2", "Tracked", int64_t{4});
  EXPECT_EQ(a_[0]->rpc_sync<std::vector<int64_t>>("w1", "rref_vector_ids",
                                                  std::vector<RRef<Tracked>>{r, other, back}),
            (std::vector<int64_t>{9, 4, 9}));
  r = back = other = RRef<Tracked>();
  EXPECT_TRUE(eventually([&] { return live() == 0; }));
  ASSERT_TRUE(quiet(a_));
  for (auto& a : a_.agents) EXPECT_EQ(a->rref_context().num_owned(), 0u);
}

// Forks of forks across three workers, deleted out of order; the value dies exactly when the
// last reference anywhere is gone.
TEST_F(RRefTest, ForksOfForksWithOutOfOrderDeletes) {
  RRef<Tracked> r = a_[0]->remote<Tracked>("w1", "Tracked", int64_t{1});  // owner w1, user w0
  const RRefId id = r.id();
  a_[0]->rpc_sync<void>("w2", "hold", r, std::string("a"));  // user -> user (w2)
  // w0 -> w2 -> w0: a fork of a fork, held by w0 in a second handle.
  a_[0]->rpc_sync<void>("w2", "forward_hold", r, std::string("w0"), std::string("b"));
  a_[0]->rpc_sync<void>("w1", "hold", r, std::string("c"));  // user -> owner: a local handle
  ASSERT_TRUE(quiet(a_));
  EXPECT_EQ(live(), 1);
  EXPECT_EQ(a_[1]->rref_context().num_forks(id), 3u);  // w0's r, w2's "a", w0's "b"

  r = RRef<Tracked>();  // the creator's fork goes first
  ASSERT_TRUE(quiet(a_));
  EXPECT_EQ(a_[1]->rref_context().num_forks(id), 2u);
  EXPECT_EQ(a_[0]->rpc_sync<int64_t>("w2", "held_id", std::string("a")), 1);

  a_[0]->rpc_sync<void>("w2", "drop", std::string("a"));
  ASSERT_TRUE(quiet(a_));
  EXPECT_EQ(a_[1]->rref_context().num_forks(id), 1u);
  EXPECT_EQ(live(), 1);

  a_[0]->rpc_sync<void>("w0", "drop", std::string("b"));  // the last user fork
  ASSERT_TRUE(quiet(a_));
  EXPECT_EQ(a_[1]->rref_context().num_forks(id), 0u);
  EXPECT_EQ(live(), 1) << "the owner's own handle still holds the value";
  EXPECT_EQ(a_[0]->rpc_sync<int64_t>("w1", "held_id", std::string("c")), 1);

  a_[0]->rpc_sync<void>("w1", "drop", std::string("c"));
  EXPECT_TRUE(eventually([&] { return live() == 0; }));
  EXPECT_EQ(destroyed(), 1) << "freed exactly once";
  ASSERT_TRUE(quiet(a_));
  EXPECT_EQ(a_[1]->rref_context().num_owned(), 0u);
}

// A parent dropped while its child's fork is still on the way: the parent stays alive until
// the owner knows the child.
TEST_F(RRefTest, ParentDroppedBeforeChildConfirmed) {
  for (int i = 0; i < 20; ++i) {
    RRef<Tracked> r = a_[0]->remote<Tracked>("w1", "Tracked", int64_t{i});
    auto f = a_[0]->rpc_async<void>("w2", "hold", r, std::string("p"));
    r = RRef<Tracked>();  // before the call even arrived
    f.wait();
    EXPECT_EQ(a_[0]->rpc_sync<int64_t>("w2", "held_id", std::string("p")), i);
    a_[0]->rpc_sync<void>("w2", "drop", std::string("p"));
  }
  EXPECT_TRUE(eventually([&] { return live() == 0; }));
  EXPECT_EQ(destroyed(), 20);
  ASSERT_TRUE(quiet(a_));
  EXPECT_EQ(a_[1]->rref_context().num_owned(), 0u);
}

TEST_F(RRefTest, ControlMessagesAreIdempotent) {
  RRef<Tracked> r = a_[0]->remote<Tracked>("w1", "Tracked", int64_t{1});
  ASSERT_TRUE(eventually([&] { return r.confirmed_by_owner(); }));
  auto user = std::static_pointer_cast<detail::UserRRef>(r.impl());
  const RRefId id = r.id();
  const ForkId fork = user->fork_id();
  auto send = [&](int from, int to, detail::MessageType type, auto fields) {
    Future<void> done;
    auto m = detail::encode_message(type, &a_[from]->rref_context(), to, fields);
    a_[from]->send_request(to, std::move(m), 10s, detail::result_handler<void>(done, {}, nullptr),
                           "test control message");
    done.wait();
  };
  using detail::MessageType;
  send(0, 1, MessageType::kRRefForkRequest, std::make_tuple(id, fork, user->secret()));  // again
  // From elsewhere: refused, w0 holds that fork (rpc_security_test.cpp has the rest).
  EXPECT_THROW(send(2, 1, MessageType::kRRefForkRequest, std::make_tuple(id, fork, user->secret())),
               RemoteError);
  EXPECT_EQ(a_[1]->rref_context().num_forks(id), 1u);
  send(0, 1, MessageType::kRRefUserDelete, std::make_tuple(id, ForkId{0, 999999}));  // unknown
  send(0, 1, MessageType::kRRefUserDelete, std::make_tuple(RRefId{2, 999999}, fork));
  send(1, 0, MessageType::kRRefChildAccept, std::make_tuple(ForkId{1, 424242}));
  EXPECT_EQ(a_[1]->rref_context().num_forks(id), 1u);
  EXPECT_EQ(live(), 1);
  r = RRef<Tracked>();
  user.reset();
  EXPECT_TRUE(eventually([&] { return live() == 0; }));
  // The same deletion once more changes nothing.
  send(0, 1, MessageType::kRRefUserDelete, std::make_tuple(id, fork));
  EXPECT_EQ(destroyed(), 1);
  EXPECT_EQ(a_[1]->rref_context().num_owned(), 0u);
}

// A handle kept past a graceful shutdown: shutdown deletes the user RRef first, so the owner
// frees the value and nothing is reported as leaked.
TEST(RRefShutdown, HandlesKeptPastShutdownAreDeleted) {
  register_test_functions();
  auto a = start_agents(2);
  const int64_t before = Tracked::live.load();
  RRef<Tracked> kept = a[0]->remote<Tracked>("w1", "Tracked", int64_t{1});
  ASSERT_EQ(kept.to_here().id(), 1);
  shutdown_all(a);
  EXPECT_TRUE(a[0]->leaked_rrefs().empty());
  EXPECT_TRUE(a[1]->leaked_rrefs().empty());
  EXPECT_EQ(Tracked::live.load(), before);  // freed on the owner during shutdown
  EXPECT_THROW(kept.to_here(), Error);      // the agent is gone
  kept = RRef<Tracked>();                   // sends nothing, does not crash
  a.agents.clear();
  EXPECT_EQ(Tracked::live.load(), before);
}

TEST(RRefShutdown, NothingLeaksWhenReferencesAreDropped) {
  register_test_functions();
  auto a = start_agents(2);
  {
    RRef<Tracked> r = a[0]->remote<Tracked>("w1", "Tracked", int64_t{1});
    a[0]->rpc_sync<void>("w1", "hold", r, std::string("x"));
    a[0]->rpc_sync<void>("w1", "drop", std::string("x"));
  }
  shutdown_all(a);  // waits for the deletions in flight
  EXPECT_TRUE(a[0]->leaked_rrefs().empty());
  EXPECT_TRUE(a[1]->leaked_rrefs().empty());
}

}  // namespace
}  // namespace tdist::rpc::test
