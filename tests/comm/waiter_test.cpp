// Who runs an operation (Note [Waiter runs the operation]): after a run of operations waited on
// at once, the group stops waking its worker and leaves new operations to their waiters. These
// tests are the ways a caller can leave that style, each of which must still make progress: an
// operation issued and never touched (the peer waits for it), a wait on a later operation while
// an earlier one is untouched, a dropped Work, a Work looked at through future(). Each rank has a
// 20 s operation timeout, so a missing hand-off fails as a timeout, never a hang.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include "tdist/comm/ring/op_queue.h"
#include "tests/comm/comm_test_util.h"

namespace tdist::comm {
namespace {

using namespace std::chrono_literals;

// Enough prompt waits to leave the group in its blocking-caller mode.
void blocking_warmup(ProcessGroup& pg) {
  for (int i = 0; i < 8; ++i) {
    auto t = torch::ones({64});
    pg.allreduce(t)->wait();
    ASSERT_EQ(t[0].item<float>(), 2.0f);
  }
}

std::shared_ptr<ProcessGroup> group(int rank, const std::shared_ptr<Store>& store) {
  return create_process_group(store, rank, 2, test::test_options(Millis(20000)));
}

// Rank 0 issues an allreduce and does not look at it until rank 1 has the result, which needs
// rank 0's part: only rank 0's worker can give it.
void untouched_operation_runs(int rank, ProcessGroup& pg, Store& store) {
  auto t = torch::full({64}, static_cast<float>(rank + 1));
  if (rank == 0) {
    auto work = pg.allreduce(t);
    store.wait({"rank1_done"}, Millis(20000));
    work->wait();
  } else {
    pg.allreduce(t)->wait();
    store.set("rank1_done", "1");
  }
  EXPECT_EQ(t[0].item<float>(), 3.0f);
}

TEST(Waiter, AnOperationNobodyTouchesStillRunsAfterBlockingUse) {
  tdist::test::spawn(2, [](int rank, std::shared_ptr<Store> store) {
    auto pg = group(rank, store);
    blocking_warmup(*pg);
    untouched_operation_runs(rank, *pg, *store);
  });
}

// The same after long blocking use: the worker, finding nothing to pick up in kLazyIdleRounds of
// kLazyPickup (0.5 s), turns the group's blocking-caller mode off and sleeps until told, and the
// caller's prompt waits turn the mode on again; an operation nobody touches then must still
// reach the worker (the wait that turns the mode on wakes it: Note [Waiter runs the operation]).
TEST(Waiter, AnOperationNobodyTouchesStillRunsAfterLongBlockingUse) {
  tdist::test::spawn(2, [](int rank, std::shared_ptr<Store> store) {
    auto pg = group(rank, store);
    for (int i = 0; i < 1000; ++i) {  // over a second: the same count on both ranks
      auto t = torch::ones({64});
      pg->allreduce(t)->wait();
      ASSERT_EQ(t[0].item<float>(), 2.0f);
      std::this_thread::sleep_for(1ms);  // blocking use, not a busy loop
    }
    pg->barrier()->wait();
    blocking_warmup(*pg);
    untouched_operation_runs(rank, *pg, *store);
  });
}

TEST(Waiter, WaitingOnALaterOperationRunsTheEarlierOneFirst) {
  tdist::test::spawn(2, [](int rank, std::shared_ptr<Store> store) {
    auto pg = group(rank, store);
    blocking_warmup(*pg);
    auto a = torch::full({64}, 1.0f), b = torch::full({1 << 16}, 10.0f);
    auto wa = pg->allreduce(a);
    auto wb = pg->allreduce(b);
    if (rank == 0) {
      wb->wait();
      EXPECT_TRUE(wa->is_completed());  // ops complete in order
      wa->wait();
    } else {
      wa->wait();
      wb->wait();
    }
    EXPECT_EQ(a[0].item<float>(), 2.0f);
    EXPECT_EQ(b[0].item<float>(), 20.0f);
  });
}

TEST(Waiter, ADroppedWorkAndAFutureStillComplete) {
  tdist::test::spawn(2, [](int rank, std::shared_ptr<Store> store) {
    auto pg = group(rank, store);
    blocking_warmup(*pg);
    auto dropped = torch::full({64}, 1.0f);
    { auto work = pg->allreduce(dropped); }  // the Work is gone at once
    blocking_warmup(*pg);                    // ordered after it: it ran
    EXPECT_EQ(dropped[0].item<float>(), 2.0f);
    auto chained = torch::full({64}, 2.0f);
    auto doubled = pg->allreduce(chained)->future()->then(
        [](Future& f) { return Future::Value{f.value()[0] * 2}; });
    // Waited on through the future only (as DDP and comm hooks do), after some work.
    std::this_thread::sleep_for(20ms);
    EXPECT_EQ(doubled->wait(Millis(20000))[0][0].item<float>(), 8.0f);
  });
}

// Note [The slot]: a blocking caller's operations go through the slot without a lock, any other
// style through the locked queue, and the group moves between the two with every switch of
// style. Both ranks draw the same sequence of styles (one seed), so every switch happens with
// an operation in the slot, in the queue, running on the waiter or on the worker. Every result
// is checked: an operation lost, run twice or run out of order shows as a wrong sum or a
// timeout, never a hang.
TEST(Waiter, EveryStyleOfUseInTurnKeepsEveryResult) {
  tdist::test::spawn(2, [](int rank, std::shared_ptr<Store> store) {
    auto pg = group(rank, store);
    std::mt19937 draw(46);
    struct Pending {
      at::Tensor t;
      std::shared_ptr<Work> work;
      std::shared_ptr<Future> future;  // looked at without counting as a look (no style change)
      float expected;
    };
    std::vector<Pending> pending;  // issued, waited on later
    const auto check = [&pending](const Pending& p) {
      ASSERT_EQ(p.t[0].item<float>(), p.expected);
      ASSERT_EQ(p.t[15].item<float>(), p.expected);
      // Operations complete in the order they were issued.
      for (const auto& q : pending) ASSERT_TRUE(q.future->completed()) << q.expected;
    };
    for (int i = 0; i < 600; ++i) {
      // Rank r gives r + 1 + i; the sum is 3 + 2i.
      Pending p{torch::full({16}, static_cast<float>(rank + 1 + i)), nullptr, nullptr,
                3.0f + 2.0f * i};
      p.work = pg->allreduce(p.t);
      p.future = p.work->future_unobserved();
      switch (draw() % 8) {
        case 0:  // kept, waited on after later ones were issued
          pending.push_back(std::move(p));
          continue;
        case 1:  // dropped at once (it still runs, in order)
          p.work.reset();
          pending.push_back(std::move(p));
          continue;
        case 2:  // polled
          while (!p.work->is_completed()) std::this_thread::yield();
          break;
        case 3:  // through its future
          p.work->future()->wait(Millis(20000));
          break;
        case 4:  // with a timeout of its own
          p.work->wait(Millis(20000));
          break;
        default:  // at once: the blocking style
          p.work->wait();
          break;
      }
      check(p);
      if (draw() % 4 == 0) {
        for (auto& q : pending) {
          if (q.work) q.work->wait();
        }
        pg->barrier()->wait();  // every dropped one ran before it
        std::vector<Pending> done;
        done.swap(pending);
        for (const auto& q : done) check(q);
      }
    }
    pg->barrier()->wait();
    std::vector<Pending> done;
    done.swap(pending);
    for (const auto& q : done) check(q);
  });
}

// Several threads push to one queue at once and wait on their operations (mostly at once, the
// slot's style, some by polling): the slot and the queue take operations concurrently, and the
// runner must see every operation exactly once, in the order of the seqs the pushes got
// (Note [The slot]: a slot operation never overtakes a queued one). The runner records what it
// runs; a real group's collectives would be matched across ranks in that order.
class RecordingRunner : public detail::OpQueue::Runner {
 public:
  Future::Result run(detail::OpQueue::Op& op, std::chrono::steady_clock::time_point) override {
    const uint64_t expected = ran_.fetch_add(1);
    if (op.seq != expected) out_of_order_.store(true);
    return Future::Result{};
  }
  void fatal(std::exception_ptr) override { ADD_FAILURE() << "fatal() called"; }
  uint64_t ran() const { return ran_.load(); }
  bool out_of_order() const { return out_of_order_.load(); }

 private:
  std::atomic<uint64_t> ran_{0};
  std::atomic<bool> out_of_order_{false};
};

TEST(Waiter, ThreadsPushingAtOnceRunInTheOrderOfTheirSeqs) {
  constexpr int kThreads = 4, kOps = 2000;
  RecordingRunner runner;
  detail::OpQueue queue(/*rank=*/0, /*run_on_waiter=*/true, runner);
  queue.start();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&queue, t] {
      for (int i = 0; i < kOps; ++i) {
        auto work = queue.push("allreduce", Millis(20000), detail::OpBody{});
        if ((i + t) % 7 == 3) {
          while (!work->is_completed()) std::this_thread::yield();
        } else {
          work->wait();
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(runner.ran(), static_cast<uint64_t>(kThreads * kOps));
  EXPECT_FALSE(runner.out_of_order()) << "an operation ran before one pushed ahead of it";
}

}  // namespace
}  // namespace tdist::comm
