// detail::ThreadPool: stop() and destruction from one of the pool's own tasks, an agent's
// shutdown() called from one of its own worker threads, the idle thread that spins for the next
// task, and agents whose spinning waits end once they are idle.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <memory>

#include "tdist/rpc/detail/thread_pool.h"
#include "tests/rpc/rpc_test_util.h"

namespace tdist::rpc::test {
namespace {

using detail::ThreadPool;

// stop() from a task finishes the queued tasks before it returns (the calling thread cannot join
// itself, so it runs them), and the pool may then be destroyed at once.
TEST(ThreadPoolStop, StopFromATaskRunsTheQueueBeforeReturning) {
  for (int threads : {1, 3}) {
    auto pool = std::make_unique<ThreadPool>(threads, nullptr);
    std::atomic<int> ran{0};
    std::atomic<int> seen_after_stop{-1};
    std::atomic<bool> in_pool{false};
    std::atomic<bool> done{false};
    pool->post([&] {
      in_pool = pool->in_pool_thread();
      for (int i = 0; i < 5; ++i) pool->post([&] { ++ran; });
      pool->stop();
      seen_after_stop = ran.load();
      done = true;
    });
    ASSERT_TRUE(eventually([&] { return done.load(); }));
    EXPECT_TRUE(in_pool.load());
    EXPECT_FALSE(pool->in_pool_thread());
    EXPECT_EQ(seen_after_stop.load(), 5) << threads << " threads";
    ASSERT_TRUE(eventually([&] { return ran.load() == 5; }));
    pool.reset();
    // After stop(), try_post refuses and post() runs the task here.
    ThreadPool stopped(1, nullptr);
    stopped.stop();
    std::function<void()> t = [&] { ++ran; };
    EXPECT_FALSE(stopped.try_post(std::move(t)));
    stopped.post([&] { ++ran; });
    EXPECT_EQ(ran.load(), 6);
  }
}

// The pool destroyed by one of its own tasks: the thread that ran it must not touch the pool
// again once the task returns.
TEST(ThreadPoolStop, DestroyedFromItsOwnTask) {
  for (int i = 0; i < 200; ++i) {
    auto* pool = new ThreadPool(2, nullptr);
    std::atomic<bool> done{false};
    std::atomic<int> ran{0};
    pool->post([&ran] { ++ran; });
    pool->post([pool, &done, &ran] {
      pool->post([&ran] { ++ran; });
      delete pool;  // joins the other thread; this one leaves after the task
      done = true;
    });
    ASSERT_TRUE(eventually([&] { return done.load(); }));
    EXPECT_EQ(ran.load(), 2);
  }
}

// A graceful shutdown waits for the agent's own work to end: from one of the agent's worker
// threads it could only time out, so it is refused there.
TEST(ThreadPoolStop, ShutdownFromTheAgentsOwnWorkerThreadIsRefused) {
  register_test_functions();
  static std::once_flag once;
  std::call_once(
      once, [] { register_function("shutdown_self", [] { current_agent()->shutdown(true); }); });
  RpcOptions o;
  o.shutdown_timeout = 3s;  // bounds the wait should the refusal be missing
  auto a = start_agents(2, o);
  try {
    a[0]->rpc_sync<void>("w1", "shutdown_self", Timeout{Millis(10000)});
    ADD_FAILURE() << "shutdown() from a worker thread returned";
  } catch (const RemoteError& e) {
    EXPECT_NE(e.remote_message().find("worker thread"), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
  }
  EXPECT_FALSE(a[1]->is_shut_down());
  EXPECT_EQ(a[0]->rpc_sync<int64_t>("w1", "add", int64_t{1}, int64_t{2}), 3);
  shutdown_all(a);
}

// The last reference to an agent dropped inside one of its own handlers: the agent is destroyed
// on its own worker thread once the handler's task is done with it. (fuzz_rpc_agent found the
// task counting itself done on the destroyed agent; ASan's run of this test saw it too.)
TEST(ThreadPoolStop, AnAgentReleasedInsideItsOwnHandlerIsDestroyedAfterTheTask) {
  register_test_functions();
  static std::shared_ptr<RpcAgent> held;
  static std::once_flag once;
  std::call_once(once, [] { register_function("release_self", [] { held.reset(); }); });
  RpcOptions o;
  o.shutdown_timeout = 3s;
  auto a = start_agents(2, o);
  held = std::move(a[1]);
  std::weak_ptr<RpcAgent> w1 = held;
  try {
    a[0]->rpc_sync<void>("w1", "release_self", Timeout{Millis(10000)});
  } catch (const NetworkError&) {
    // The answer may be lost with the agent's connections: either ending is fine.
  }
  EXPECT_TRUE(eventually([&] { return w1.expired(); }, 10s));
  // The count reaches zero before the destructor closes the agent's connections: a call sent
  // in between may still be served. Once one fails, the worker is gone for good.
  auto call_fails = [&] {
    try {
      a[0]->rpc_sync<int64_t>("w1", "add", Timeout{Millis(5000)}, int64_t{1}, int64_t{2});
      return false;
    } catch (const std::exception&) {
      return true;
    }
  };
  EXPECT_TRUE(eventually(call_fails, 10s));
  EXPECT_THROW(a[0]->rpc_sync<int64_t>("w1", "add", int64_t{1}, int64_t{2}), NetworkError);
  a[0]->shutdown(false);
}

// A spinning thread takes one task: one posted meanwhile wakes a sleeping thread, so a task
// that waits for the next one to run is never stuck behind it.
TEST(ThreadPoolSpin, ATaskPostedWhileOneThreadSpinsWakesASleeper) {
  for (int i = 0; i < 300; ++i) {
    ThreadPool pool(2, nullptr, std::chrono::seconds(30));
    // Let one thread spin and the other sleep.
    std::this_thread::sleep_for(std::chrono::microseconds(200 + (i % 10) * 50));
    std::atomic<bool> second_ran{false};
    std::atomic<bool> first_saw{false};
    pool.post([&] { first_saw = eventually([&] { return second_ran.load(); }, 10s); });
    pool.post([&] { second_ran = true; });
    ASSERT_TRUE(eventually([&] { return second_ran.load(); }, 15s)) << "round " << i;
    ASSERT_TRUE(eventually([&] { return first_saw.load(); }, 15s)) << "round " << i;
  }
}

// The spin is bounded: an idle pool sleeps (it burns no core), and stop() ends a spin at once.
TEST(ThreadPoolSpin, AnIdlePoolSleepsAndStopEndsASpin) {
  {
    ThreadPool pool(4, nullptr, std::chrono::milliseconds(2));
    std::atomic<int> ran{0};
    for (int i = 0; i < 10; ++i) pool.post([&] { ++ran; });
    ASSERT_TRUE(eventually([&] { return ran.load() == 10; }));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const double before = cpu_seconds();
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    // A thread spinning all along would have used about 0.5 s.
    EXPECT_LT(cpu_seconds() - before, 0.2);
  }
  std::atomic<bool> stopped{false};
  std::thread t([&] {
    ThreadPool pool(2, nullptr, std::chrono::seconds(600));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    pool.stop();
    stopped = true;
  });
  EXPECT_TRUE(eventually([&] { return stopped.load(); }, 60s)) << "stop() waited out a spin";
  t.join();
}

// The agents' spinning waits end: two agents that just made many calls burn no core once idle;
// a bad spin_us is refused.
TEST(RpcSpin, IdleAgentsBurnNoCoreAndABadSpinIsRefused) {
  register_test_functions();
  RpcOptions o;
  o.spin_us = 2000;  // long spins, so that one left running would show
  auto a = start_agents(2, o);
  for (int i = 0; i < 200; ++i) {
    ASSERT_EQ(a[0]->rpc_sync<int64_t>("w1", "add", int64_t{i}, int64_t{1}), i + 1);
    ASSERT_EQ(a[1]->rpc_sync<int64_t>("w0", "add", int64_t{i}, int64_t{2}), i + 2);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const double before = cpu_seconds();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_LT(cpu_seconds() - before, 0.2);
  shutdown_all(a);
  RpcOptions bad;
  bad.spin_us = -2;
  try {
    start_agents(1, bad);
    ADD_FAILURE() << "spin_us -2 was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("spin_us"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tdist::rpc::test
