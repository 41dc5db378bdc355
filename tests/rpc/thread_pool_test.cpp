// detail::ThreadPool: stop() and destruction from one of the pool's own tasks, and an agent's
// shutdown() called from one of its own worker threads.
#include <gtest/gtest.h>

#include <atomic>
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
  std::call_once(once, [] {
    register_function("shutdown_self", [] { current_agent()->shutdown(true); });
  });
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

}  // namespace
}  // namespace tdist::rpc::test
