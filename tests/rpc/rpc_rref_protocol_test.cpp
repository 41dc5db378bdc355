// The RRef protocol when things go wrong: a fork request that fails or times out, requests for
// RRefs their owner does not know, deletions under full socket buffers, and what a graceful
// shutdown does with the user RRefs still held.
#include <gtest/gtest.h>

#include <condition_variable>

#include "tests/rpc/rpc_test_util.h"

namespace tdist::rpc::test {
namespace {

// A gate that the registered function "gate_wait" blocks on until the test opens it: holds an
// owner's only worker thread busy for exactly as long as a test needs.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = true;
  int waiting = 0;
  void close() {
    std::lock_guard<std::mutex> lock(mu);
    open = false;
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(mu);
      open = true;
    }
    cv.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mu);
    ++waiting;
    cv.notify_all();
    cv.wait_for(lock, 60s, [&] { return open; });  // bounded: a failing test still ends
    --waiting;
  }
  bool wait_for_waiter() {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, 20s, [&] { return waiting > 0; });
  }
};

Gate& gate() {
  static Gate g;
  return g;
}

void register_gate() {
  static std::once_flag once;
  std::call_once(once, [] { register_function("gate_wait", [] { gate().wait(); }); });
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += "\n  " + x;
  return s;
}

// Sends a raw control message or fetch from `from` to `to` and waits for its answer.
template <class Fields>
void send_raw(Agents& a, int from, int to, detail::MessageType type, Fields fields,
              Millis timeout = 10s) {
  Future<void> done;
  auto m = detail::encode_message(type, &a[from]->rref_context(), to, fields);
  a[from]->send_request(to, std::move(m), timeout, detail::result_handler<void>(done, {}, nullptr),
                        "test message");
  done.wait();
}

void drop_held(const std::string& key) {
  std::lock_guard<std::mutex> lock(held_mu());
  held_rrefs().erase(key);
}

// ---- item 8: fork requests that fail --------------------------------------------------------

// The child's FORK_REQUEST times out (the owner's only worker thread is busy): the child must
// stay pending and must not send CHILD_ACCEPT, so that the parent keeps its own fork and the
// owner cannot free the value the child holds.
TEST(RRefForkFailure, ATimedOutForkRequestKeepsTheChildPending) {
  register_gate();
  torch::set_num_threads(1);
  auto a = start_agents(3, [](int rank) {
    RpcOptions o;
    o.rpc_timeout = rank == 2 ? Millis(300) : Millis(30000);  // w2: the child, impatient
    o.num_worker_threads = rank == 1 ? 1 : 4;                 // w1: the owner, one thread
    return o;
  });
  const int64_t live_before = Tracked::live.load();
  RRef<Tracked> r = a[0]->remote<Tracked>("w1", "Tracked", int64_t{1});
  ASSERT_EQ(r.to_here().id(), 1);
  ASSERT_EQ(a[2]->rpc_sync<int64_t>("w1", "add", int64_t{1}, int64_t{1}), 2);  // w2 -> w1 up

  gate().close();
  auto busy = a[0]->rpc_async<void>("w1", "gate_wait");
  ASSERT_TRUE(gate().wait_for_waiter());
  // w0 (a user) shares its RRef with w2: w2's FORK_REQUEST waits behind the gate and times out.
  a[0]->rpc_sync<void>("w2", "hold", r, std::string("k"));
  ASSERT_TRUE(eventually([&] { return a[2]->num_pending() == 0; }));
  std::this_thread::sleep_for(300ms);  // a CHILD_ACCEPT sent by mistake would land meanwhile
  EXPECT_EQ(a[0]->rref_context().num_pending(), 1u)
      << "the parent let go of its fork although the owner never registered the child";
  EXPECT_EQ(a[2]->rref_context().num_pending(), 1u) << "the child's fork is not pending";
  // The owner registered the fork at once, on the connection's reader (Note [RRef protocol]
  // invariant 7); only its answer waited behind the gate, too long for w2.
  EXPECT_EQ(a[1]->rref_context().num_forks(r.id()), 2u);

  const RRefId id = r.id();
  r = RRef<Tracked>();  // the parent drops its handle: its fork must survive (pending child)
  gate().release();
  busy.wait();
  // The owner now handles the late FORK_REQUEST and the value stays alive for the child.
  ASSERT_TRUE(eventually([&] { return a[1]->rref_context().num_forks(id) == 2; }));
  EXPECT_EQ(a[0]->rpc_sync<int64_t>("w2", "held_id", std::string("k")), 1);
  EXPECT_EQ(Tracked::live.load(), live_before + 1);
  // What the failed fork left behind is kept (never freed early) and reported at shutdown.
  shutdown_all(a);
  EXPECT_FALSE(a[0]->leaked_rrefs().empty());
  EXPECT_FALSE(a[1]->leaked_rrefs().empty());
  EXPECT_FALSE(a[2]->leaked_rrefs().empty());
  drop_held("w2/k");
  a.agents.clear();
  EXPECT_EQ(Tracked::live.load(), live_before);
}

// Requests naming an RRef that its owner has deleted fail; they create nothing on the owner.
TEST(RRefForkFailure, RequestsForADeletedRRefFail) {
  torch::set_num_threads(1);
  auto a = start_agents(3, [](int rank) {
    RpcOptions o;
    // The owner gives up waiting for an RRef created elsewhere after its rpc_timeout.
    o.rpc_timeout = rank == 1 ? Millis(500) : Millis(30000);
    return o;
  });
  const int64_t live_before = Tracked::live.load();
  const auto fetch_fields = [](const RRefId& id) {
    const auto& ti = detail::type_info_of<Tracked>();
    return std::make_tuple(id, ti.hash, ti.name);
  };
  using detail::MessageType;

  // An RRef created by w0's remote(): its id was made on w0.
  RRef<Tracked> r = a[0]->remote<Tracked>("w1", "Tracked", int64_t{1});
  ASSERT_EQ(r.to_here().id(), 1);
  const RRefId remote_id = r.id();
  r = RRef<Tracked>();
  ASSERT_TRUE(eventually([&] { return a[1]->rref_context().num_owned() == 0; }));
  ASSERT_TRUE(eventually([&] { return Tracked::live.load() == live_before; }));
  EXPECT_THROW(send_raw(a, 2, 1, MessageType::kRRefForkRequest,
                        std::make_tuple(remote_id, ForkId{2, 1000001}, detail::RRefSecret{})),
               RemoteError);
  EXPECT_THROW(send_raw(a, 2, 1, MessageType::kRRefFetch, fetch_fields(remote_id), 5s),
               RemoteError);

  // An RRef its owner made itself (make_rref on w1): unknown means deleted, at once.
  RRef<Tracked> l = a[0]->rpc_sync<RRef<Tracked>>("w1", "local_rref", int64_t{2});
  const RRefId local_id = l.id();
  l = RRef<Tracked>();
  ASSERT_TRUE(eventually([&] { return a[1]->rref_context().num_owned() == 0; }));
  EXPECT_THROW(send_raw(a, 2, 1, MessageType::kRRefForkRequest,
                        std::make_tuple(local_id, ForkId{2, 1000002}, detail::RRefSecret{})),
               RemoteError);
  EXPECT_THROW(send_raw(a, 2, 1, MessageType::kRRefFetch, fetch_fields(local_id), 5s), RemoteError);

  ASSERT_TRUE(quiet(a));
  EXPECT_EQ(a[1]->rref_context().num_owned(), 0u);
  EXPECT_TRUE(a[1]->rref_context().registered().empty())
      << joined(a[1]->rref_context().registered());
  shutdown_all(a);
  for (auto& agent : a.agents) EXPECT_TRUE(agent->leaked_rrefs().empty());
}

// A fetch that overtakes the REMOTE_CALL creating its RRef still gets the value (the owner waits
// for the creation when the id was made elsewhere).
TEST(RRefForkFailure, AFetchBeforeTheCreationStillWorks) {
  torch::set_num_threads(1);
  auto a = start_agents(2);
  for (int i = 0; i < 200; ++i) {
    RRef<Tracked> r = a[0]->remote<Tracked>("w1", "Tracked", int64_t{i});
    EXPECT_EQ(r.to_here_async().value().id(), i);
    EXPECT_EQ(a[0]->rpc_sync<int64_t>("w1", "rref_id_of", r), i);
  }
  ASSERT_TRUE(quiet(a));
  shutdown_all(a);
  for (auto& agent : a.agents) EXPECT_TRUE(agent->leaked_rrefs().empty());
}

// ---- item 9: deletions never written by a connection's reader thread ------------------------

// Thousands of RRefs created and dropped in both directions with tiny socket buffers, each
// dropped while its to_here() is in flight, so that the response completes on the reader thread
// and releases the last reference there.
TEST(RRefDeletion, ThousandsOfDropsUnderFullSocketBuffers) {
  torch::set_num_threads(1);
  RpcOptions o;
  o.rpc_timeout = 60s;
  o.socket_buffer_bytes = 4096;
  o.same_host_fast_path = false;
  auto a = start_agents(2, o);
  const int64_t live_before = Tracked::live.load();
  constexpr int kPerSide = 1500;
  std::vector<std::thread> threads;
  std::vector<int> bad(2, 0);
  for (int side = 0; side < 2; ++side) {
    threads.emplace_back([&, side] {
      auto& me = a[side];
      const int other = 1 - side;
      std::vector<Future<at::Tensor>> fetches;
      std::vector<Future<int64_t>> ids;
      for (int i = 0; i < kPerSide; ++i) {
        RRef<at::Tensor> t = me->remote<at::Tensor>(other, "echo", torch::full({2048}, i));
        fetches.push_back(t.to_here_async());
        RRef<Tracked> k = me->remote<Tracked>(other, "Tracked", int64_t{i});
        ids.push_back(k.rpc_async<int64_t>("id"));
        // t and k go here: the last references are the ones the calls hold.
      }
      for (int i = 0; i < kPerSide; ++i) {
        try {
          if (fetches[i].value()[7].item<float>() != i || ids[i].value() != i) ++bad[side];
        } catch (const std::exception& e) {
          if (bad[side]++ == 0) std::fprintf(stderr, "side %d: %s\n", side, e.what());
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad[0], 0);
  EXPECT_EQ(bad[1], 0);
  ASSERT_TRUE(quiet(a));
  ASSERT_TRUE(eventually([&] {
    return a[0]->rref_context().num_owned() == 0 && a[1]->rref_context().num_owned() == 0;
  })) << "owned: "
      << a[0]->rref_context().num_owned() << ", " << a[1]->rref_context().num_owned();
  EXPECT_EQ(Tracked::live.load(), live_before);
  shutdown_all(a);
  for (auto& agent : a.agents) EXPECT_TRUE(agent->leaked_rrefs().empty());
}

// ---- item 10: graceful shutdown deletes the user RRefs still held ---------------------------

TEST(RRefShutdownDeletes, UserRRefsHeldAtShutdownAreDeleted) {
  torch::set_num_threads(1);
  auto a = start_agents(3);
  const int64_t live_before = Tracked::live.load();
  RRef<Tracked> kept = a[0]->remote<Tracked>("w1", "Tracked", int64_t{1});
  ASSERT_EQ(kept.to_here().id(), 1);
  a[0]->rpc_sync<void>("w2", "hold", kept, std::string("s"));  // a user's fork, shared
  RRef<Tracked> from_owner = a[0]->rpc_sync<RRef<Tracked>>("w1", "local_rref", int64_t{2});
  RRef<Tracked> own = make_rref(a[2], Tracked(3));  // owned by w2, never shared
  ASSERT_TRUE(quiet(a));
  EXPECT_EQ(Tracked::live.load(), live_before + 3);

  shutdown_all(a);
  for (auto& agent : a.agents) {
    EXPECT_TRUE(agent->leaked_rrefs().empty()) << joined(agent->leaked_rrefs());
  }
  EXPECT_EQ(a[1]->rref_context().num_owned(), 0u);
  // The owner freed both values while its agent still exists; w2's own handle keeps its value.
  EXPECT_EQ(Tracked::live.load(), live_before + 1);
  kept = from_owner = RRef<Tracked>();  // after shutdown: sends nothing
  drop_held("w2/s");
  own = RRef<Tracked>();
  EXPECT_EQ(Tracked::live.load(), live_before);
}

}  // namespace
}  // namespace tdist::rpc::test
