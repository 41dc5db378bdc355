// Heap allocations of a warm small allreduce (issue 46): this binary replaces the global
// operator new and counts every call, per thread and in all, so it is its own test program (no
// other source may see the replacement). Two ranks run as threads of this process; after a
// warm-up both meet at an allocation-free barrier, run kOps allreduces of 4 KiB each, and meet
// again. The calling thread's count is its own; everything else the process allocated meanwhile
// (the groups' worker threads, the other rank) is the rest. Both must stay at or under the
// fixed numbers below, so a change that adds an allocation to the small-operation path fails.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <thread>

#include "tests/comm/comm_test_util.h"

namespace {
std::atomic<uint64_t> g_allocations{0};
thread_local uint64_t t_allocations = 0;

void* counted(std::size_t n, std::size_t align) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  ++t_allocations;
  if (n == 0) n = 1;
  void* p = align > alignof(std::max_align_t) ? std::aligned_alloc(align, (n + align - 1) / align * align)
                                              : std::malloc(n);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(std::size_t n) { return counted(n, 0); }
void* operator new[](std::size_t n) { return counted(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) { return counted(n, static_cast<size_t>(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return counted(n, static_cast<size_t>(a)); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace tdist::comm {
namespace {

// More than the block pool keeps per thread (64), so that its caches have filled before counting.
constexpr int kWarmup = 200;
constexpr int kOps = 256;

// Meets the other rank without allocating (a spin on an atomic generation count).
struct SpinBarrier {
  std::atomic<int> arrived{0};
  std::atomic<int> generation{0};
  void wait(int parties) {
    const int gen = generation.load();
    if (arrived.fetch_add(1) + 1 == parties) {
      arrived.store(0);
      generation.fetch_add(1);
    } else {
      while (generation.load() == gen) std::this_thread::yield();
    }
  }
};

struct Counts {
  uint64_t caller[2] = {0, 0};
  uint64_t all = 0;
};

// kOps warm 4 KiB allreduces per rank, each waited on at once, counted as the file comment says.
Counts count_small_allreduces(bool run_on_waiter, bool keep_work) {
  tdist::test::EnvGuard env({{"TDIST_RUN_ON_WAITER", std::string(run_on_waiter ? "1" : "0")}});
  Counts counts;
  SpinBarrier barrier;
  uint64_t all_before = 0;
  tdist::test::spawn(2, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 2, test::test_options(Millis(20000)));
    auto t = torch::ones({1024});  // 4 KiB of float32
    for (int i = 0; i < kWarmup; ++i) pg->allreduce(t)->wait();
    std::shared_ptr<Work> kept;
    barrier.wait(2);
    if (rank == 0) all_before = g_allocations.load();
    barrier.wait(2);
    const uint64_t mine = t_allocations;
    for (int i = 0; i < kOps; ++i) {
      if (keep_work) {
        kept = pg->allreduce(t);
        kept->wait();
      } else {
        pg->allreduce(t)->wait();
      }
    }
    counts.caller[rank] = t_allocations - mine;
    barrier.wait(2);
    if (rank == 0) counts.all = g_allocations.load() - all_before;
    barrier.wait(2);
    // Every element went through kWarmup + kOps doublings: not worth checking exactly, but the
    // operations did run.
    EXPECT_GT(t[0].item<float>(), 1.0f);
    pg->barrier()->wait();
  });
  return counts;
}

// The fixed number this path reaches: at most one allocation per operation on all threads
// together (the result list: Note [Small operations] in comm/ring/ring_process_group.cpp), on the
// calling thread or on the worker, plus a few once (a pool growing by a block when a Work is kept
// while the next is made).
constexpr uint64_t kPerOp = 1;
constexpr uint64_t kOnce = 4;

void expect_within(const Counts& c) {
  for (int r = 0; r < 2; ++r) {
    EXPECT_LE(c.caller[r], kPerOp * kOps + kOnce)
        << "rank " << r << "'s calling thread allocated " << c.caller[r] << " times in " << kOps
        << " allreduces";
  }
  // Over all threads the count varies with timing: 512 to 577 were seen for 2 x 256 operations
  // on the loaded 2-core machine (a calling thread now and then allocates too). Half an
  // allocation per operation of slack still fails as soon as one more is added to every call.
  EXPECT_LE(c.all, 2 * (kPerOp * kOps + kOps / 2 + kOnce))
      << "the process allocated " << c.all << " times in " << kOps
      << " allreduces on each of 2 ranks (" << c.caller[0] + c.caller[1]
      << " of them on the calling threads, the rest on the groups' workers)";
}

TEST(SmallOpAllocations, WaiterRunsTheAllreduce) {
  expect_within(count_small_allreduces(/*run_on_waiter=*/true, /*keep_work=*/false));
}

TEST(SmallOpAllocations, WorkerRunsTheAllreduce) {
  expect_within(count_small_allreduces(/*run_on_waiter=*/false, /*keep_work=*/false));
}

TEST(SmallOpAllocations, WorkKeptUntilTheNextCall) {
  expect_within(count_small_allreduces(/*run_on_waiter=*/true, /*keep_work=*/true));
}

}  // namespace
}  // namespace tdist::comm
