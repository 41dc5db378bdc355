// Heap allocations and locks of warm small collectives (issue 46): this binary replaces the
// global operator new and pthread_mutex_lock (and _trylock) and counts every call, per thread and
// in all, so it is its own test program (no other source may see the replacement). Two ranks run
// as threads of this process; after a warm-up both meet at an allocation-free barrier, run kOps
// operations of 4 KiB each (an allreduce, a broadcast, an allgather or a reduce-scatter, list or
// flat), and meet again. A list operation's lists are built before the count starts (the API
// takes them by value: the caller moves one in). The calling thread's count is its own;
// everything else the process allocated meanwhile (the groups' worker threads, the other rank)
// is the rest. Both must stay at or under the fixed numbers below, so a change that adds an
// allocation (or, where the caller runs its operations, a lock) to the small-operation path
// fails.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <dlfcn.h>
#include <pthread.h>

#include <atomic>
#include <cstdlib>
#include <iostream>
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
  void* p = align > alignof(std::max_align_t)
                ? std::aligned_alloc(align, (n + align - 1) / align * align)
                : std::malloc(n);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

// pthread_mutex_lock and _trylock, interposed: every std::mutex lock of the process comes here
// first (the executable's definition wins over libc's), counted per thread.
thread_local uint64_t t_locks = 0;
namespace {
template <typename Fn>
Fn real_function(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_NEXT, name));
}
}  // namespace
extern "C" int pthread_mutex_lock(pthread_mutex_t* m) {
  using Fn = int (*)(pthread_mutex_t*);
  static Fn real = real_function<Fn>("pthread_mutex_lock");
  ++t_locks;
  return real(m);
}
extern "C" int pthread_mutex_trylock(pthread_mutex_t* m) {
  using Fn = int (*)(pthread_mutex_t*);
  static Fn real = real_function<Fn>("pthread_mutex_trylock");
  ++t_locks;
  return real(m);
}

void* operator new(std::size_t n) { return counted(n, 0); }
void* operator new[](std::size_t n) { return counted(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) { return counted(n, static_cast<size_t>(a)); }
void* operator new[](std::size_t n, std::align_val_t a) {
  return counted(n, static_cast<size_t>(a));
}
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
constexpr int64_t kElems = 1024;  // 4 KiB of float32 per rank

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
  uint64_t caller_locks[2] = {0, 0};
};

enum class Op {
  kAllreduce,
  kBroadcast,
  kAllgather,
  kAllgatherInto,
  kReduceScatter,
  kReduceScatterTensor
};

// One rank's tensors and the call of `op` on them; check() verifies the last call's result.
struct Caller {
  Op op;
  int rank;
  at::Tensor mine = torch::full({kElems}, 1.0f);  // allreduce, broadcast, allgather input
  at::Tensor flat = torch::empty({2 * kElems});   // allgather_into output, reduce-scatter input
  at::Tensor out = torch::empty({kElems});        // reduce-scatter output
  std::vector<std::vector<at::Tensor>> lists;     // one per call, built before counting
  int calls = 0;

  Caller(Op o, int r) : op(o), rank(r) {
    if (op != Op::kAllreduce) mine.fill_(rank + 1);
    flat.fill_(rank + 1);
    std::vector<at::Tensor> list = {torch::empty({kElems}), torch::empty({kElems})};
    if (op == Op::kReduceScatter) {
      for (auto& t : list) t.fill_(rank + 1);
    }
    if (op == Op::kAllgather || op == Op::kReduceScatter) {
      lists.assign(kWarmup + kOps, list);
    }
  }
  std::shared_ptr<Work> call(ProcessGroup& pg) {
    const int i = calls++;
    switch (op) {
      case Op::kAllreduce:
        return pg.allreduce(mine);
      case Op::kBroadcast: {
        BroadcastOptions o;
        o.root = 1;
        return pg.broadcast(mine, o);
      }
      case Op::kAllgather:
        return pg.allgather(std::move(lists[i]), mine);
      case Op::kAllgatherInto:
        return pg.allgather_into_tensor(flat, mine);
      case Op::kReduceScatter:
        return pg.reduce_scatter(out, std::move(lists[i]));
      case Op::kReduceScatterTensor:
        return pg.reduce_scatter_tensor(out, flat);
    }
    return nullptr;
  }
  // `last`: the last call's Work, still held.
  void check(const Work& last) const {
    if (op != Op::kAllgather) {  // the one output tensor, listed now that it is asked for
      ASSERT_EQ(last.result().size(), 1u);
      const at::Tensor& output = op == Op::kAllgatherInto ? flat
                                 : op == Op::kReduceScatter || op == Op::kReduceScatterTensor
                                     ? out
                                     : mine;
      EXPECT_TRUE(last.result()[0].is_same(output));
    }
    switch (op) {
      case Op::kAllreduce:
        // Every element went through kWarmup + kOps doublings: not worth checking exactly, but
        // the operations did run.
        EXPECT_GT(mine[0].item<float>(), 1.0f);
        break;
      case Op::kBroadcast:
        EXPECT_EQ(mine.sum().item<float>(), 2.0f * kElems);  // rank 1's value
        break;
      case Op::kAllgather:
        ASSERT_EQ(last.result().size(), 2u);
        EXPECT_EQ(last.result()[0].sum().item<float>(), 1.0f * kElems);
        EXPECT_EQ(last.result()[1].sum().item<float>(), 2.0f * kElems);
        break;
      case Op::kAllgatherInto:
        EXPECT_EQ(flat.narrow(0, 0, kElems).sum().item<float>(), 1.0f * kElems);
        EXPECT_EQ(flat.narrow(0, kElems, kElems).sum().item<float>(), 2.0f * kElems);
        break;
      case Op::kReduceScatter:
      case Op::kReduceScatterTensor:
        EXPECT_EQ(out.sum().item<float>(), 3.0f * kElems);  // 1 + 2
        break;
    }
  }
};

// kOps warm calls of `op` per rank, each waited on at once, counted as the file comment says.
Counts count_small_ops(Op op, bool run_on_waiter, bool keep_work) {
  tdist::test::EnvGuard env({{"TDIST_RUN_ON_WAITER", std::string(run_on_waiter ? "1" : "0")}});
  Counts counts;
  SpinBarrier barrier;
  uint64_t all_before = 0;
  tdist::test::spawn(2, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 2, test::test_options(Millis(20000)));
    Caller caller(op, rank);
    for (int i = 0; i < kWarmup; ++i) caller.call(*pg)->wait();
    std::shared_ptr<Work> kept;
    barrier.wait(2);
    if (rank == 0) all_before = g_allocations.load();
    barrier.wait(2);
    const uint64_t mine = t_allocations;
    const uint64_t my_locks = t_locks;
    for (int i = 0; i < kOps; ++i) {
      if (keep_work || i + 1 == kOps) {
        kept = caller.call(*pg);
        kept->wait();
      } else {
        caller.call(*pg)->wait();
      }
    }
    counts.caller[rank] = t_allocations - mine;
    counts.caller_locks[rank] = t_locks - my_locks;
    barrier.wait(2);
    if (rank == 0) counts.all = g_allocations.load() - all_before;
    barrier.wait(2);
    caller.check(*kept);
    pg->barrier()->wait();
  });
  return counts;
}

// The fixed numbers this path reaches: no allocation per operation (Note [Small operations] in
// comm/ring/op_queue.cpp: the result's list is made only when asked for, and a list
// allgather's list comes back as its result), plus a few once (a pool growing by a block when a
// Work is kept while the next is made). Until 2026-11-29 every operation but the list allgather
// made its result list: 256 per calling thread, which fails here.
constexpr uint64_t kOnce = 4;

void expect_within(const Counts& c) {
  std::cout << "allocations in " << kOps << " operations: calling threads " << c.caller[0] << " + "
            << c.caller[1] << ", all threads " << c.all << "; locks on the calling threads "
            << c.caller_locks[0] << " + " << c.caller_locks[1] << "\n";
  // A calling thread also allocates now and then with timing (14 in 256 list allgathers on the
  // worker were seen in a cold CI run): the same half an allocation per operation of slack as
  // below, which still fails as soon as one more is added to every call.
  for (int r = 0; r < 2; ++r) {
    EXPECT_LE(c.caller[r], kOps / 2 + kOnce)
        << "rank " << r << "'s calling thread allocated " << c.caller[r] << " times in " << kOps
        << " operations";
  }
  // Over all threads the count varies with timing too (512 to 577 were seen for 2 x 256
  // allreduces on the loaded 2-core machine when each made its result list). Half an allocation
  // per operation of slack still fails as soon as one is added to every call.
  EXPECT_LE(c.all, 2 * (kOps / 2 + kOnce))
      << "the process allocated " << c.all << " times in " << kOps
      << " operations on each of 2 ranks (" << c.caller[0] + c.caller[1]
      << " of them on the calling threads, the rest on the groups' workers)";
}

struct Case {
  Op op;
  const char* name;
};

class SmallOpAllocations : public ::testing::TestWithParam<Case> {};

// A caller that waits at once runs its operation itself and takes no lock (Note [The slot] in
// comm/ring/op_queue.cpp, Note [Completing without a lock] in comm/work.cpp). Before
// 2026-11-29 every such operation took four (the queue's mutex three times, the Future's once):
// 1024 in 256 operations, which fails here. The slack (an eighth of a lock per operation)
// still fails as soon as one is added to every call.
void expect_no_locks(const Counts& c) {
  for (int r = 0; r < 2; ++r) {
    EXPECT_LE(c.caller_locks[r], kOps / 8)
        << "rank " << r << "'s calling thread took " << c.caller_locks[r] << " locks in " << kOps
        << " operations";
  }
}

TEST_P(SmallOpAllocations, WaiterRunsTheOperation) {
  const Counts c = count_small_ops(GetParam().op, /*run_on_waiter=*/true, /*keep_work=*/false);
  expect_within(c);
  expect_no_locks(c);
}

TEST_P(SmallOpAllocations, WorkerRunsTheOperation) {
  expect_within(count_small_ops(GetParam().op, /*run_on_waiter=*/false,
                                /*keep_work=*/false));
}

TEST_P(SmallOpAllocations, WorkKeptUntilTheNextCall) {
  const Counts c = count_small_ops(GetParam().op, /*run_on_waiter=*/true, /*keep_work=*/true);
  expect_within(c);
  expect_no_locks(c);
}

INSTANTIATE_TEST_SUITE_P(Ops, SmallOpAllocations,
                         ::testing::Values(Case{Op::kAllreduce, "allreduce"},
                                           Case{Op::kBroadcast, "broadcast"},
                                           Case{Op::kAllgather, "allgather"},
                                           Case{Op::kAllgatherInto, "allgather_into_tensor"},
                                           Case{Op::kReduceScatter, "reduce_scatter"},
                                           Case{Op::kReduceScatterTensor, "reduce_scatter_tensor"}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace tdist::comm
