// Who runs an operation (Note [Waiter runs the operation]): after a run of operations waited on
// at once, the group stops waking its worker and leaves new operations to their waiters. These
// tests are the ways a caller can leave that style, each of which must still make progress: an
// operation issued and never touched (the peer waits for it), a wait on a later operation while
// an earlier one is untouched, a dropped Work, a Work looked at through future(). Each rank has a
// 20 s operation timeout, so a missing hand-off fails as a timeout, never a hang.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <thread>

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

TEST(Waiter, AnOperationNobodyTouchesStillRunsAfterBlockingUse) {
  tdist::test::spawn(2, [](int rank, std::shared_ptr<Store> store) {
    auto pg = group(rank, store);
    blocking_warmup(*pg);
    auto t = torch::full({64}, static_cast<float>(rank + 1));
    if (rank == 0) {
      auto work = pg->allreduce(t);  // not looked at until rank 1 has its result
      store->wait({"rank1_done"}, Millis(20000));
      work->wait();
    } else {
      pg->allreduce(t)->wait();  // needs rank 0's part, which only rank 0's worker can give
      store->set("rank1_done", "1");
    }
    EXPECT_EQ(t[0].item<float>(), 3.0f);
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

}  // namespace
}  // namespace tdist::comm
