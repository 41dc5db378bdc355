// How the allreduce algorithms scale with the world, by counting (issue 46): every rank reads its
// Exchange's counts of one allreduce (RingProcessGroup::last_counts) and the test checks the
// algorithm the group picked at each size against its Note's arithmetic: recursive doubling
// (Note [Recursive doubling]) moves the whole buffer once per round, log2 n rounds at a power
// of two; the ring (Note [Streaming ring]) makes 2(n-1) hops of one segment each, 2(n-1)/n of the
// buffer per rank. The dependent hand-offs are counted exactly (runs, and forwards: sends that
// waited for a receive); the wake-ups they cost (sleeps) depend on timing and are printed, not
// checked. Worlds 2, 3
// and 4 here; TDIST_TEST_COUNT_WORLD=<n> adds world n (docs/perf.md's world-8 counts came from
// it, run by hand).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <iostream>

#include "tdist/comm/ring/ring_process_group.h"
#include "tests/comm/comm_test_util.h"

namespace tdist::comm {
namespace {

using Counts = detail::Exchange::Counts;

std::vector<Counts> counts_of_one_allreduce(int world, int64_t count) {
  // One chunk per ring segment, so that a hop is one send.
  tdist::test::EnvGuard env({{"TDIST_CHUNK_BYTES", std::string("16777216")},
                             {"TDIST_ALLREDUCE_ALGO", std::nullopt},
                             {"TDIST_SMALL_ALLREDUCE_BYTES", std::nullopt}});
  std::vector<Counts> out(static_cast<size_t>(world));
  tdist::test::spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, world, test::test_options(Millis(20000)));
    auto* ring = dynamic_cast<detail::RingProcessGroup*>(pg.get());
    ASSERT_NE(ring, nullptr);
    auto t = torch::full({count}, static_cast<float>(rank + 1));
    pg->allreduce(t)->wait();
    out[static_cast<size_t>(rank)] = ring->last_counts();
    EXPECT_EQ(t[count - 1].item<float>(), world * (world + 1) / 2.0f);
    pg->barrier()->wait();
  });
  return out;
}

std::vector<int> worlds() {
  std::vector<int> w{2, 3, 4};
  if (const char* extra = std::getenv("TDIST_TEST_COUNT_WORLD")) w.push_back(std::atoi(extra));
  return w;
}

void print(const char* algo, int world, uint64_t bytes, const std::vector<Counts>& cs) {
  for (size_t r = 0; r < cs.size(); ++r) {
    const Counts& c = cs[r];
    std::cout << algo << " world " << world << " " << bytes << " B rank " << r << ": runs "
              << c.runs << ", sends " << c.sends << ", sent " << c.bytes_sent << ", received "
              << c.bytes_received << ", forwards " << c.forwards << ", sleeps " << c.sleeps
              << ", spins run out " << c.spins_run_out << "\n";
  }
}

TEST(ScalingCounts, RecursiveDoublingMovesTheBufferOncePerRound) {
  constexpr int64_t kCount = 4096;  // 16 KiB: recursive doubling at every world
  const uint64_t b = kCount * 4;
  for (int n : worlds()) {
    SCOPED_TRACE(testing::Message() << "world " << n);
    const auto cs = counts_of_one_allreduce(n, kCount);
    print("recursive doubling", n, b, cs);
    int p = 1, rounds = 0;
    while (p * 2 <= n) p *= 2, ++rounds;
    const int rem = n - p;
    for (int r = 0; r < n; ++r) {
      SCOPED_TRACE(testing::Message() << "rank " << r);
      const Counts& c = cs[static_cast<size_t>(r)];
      uint64_t sends, received, runs;
      if (r < 2 * rem && r % 2 == 0) {  // hands its buffer over and gets the result back
        sends = 1, received = 1, runs = 1;
      } else if (r < 2 * rem) {  // takes its partner's part, the rounds, gives the result back
        sends = rounds + 1, received = rounds + 1, runs = rounds + 2;
      } else {
        sends = rounds, received = rounds, runs = rounds;
      }
      EXPECT_EQ(c.sends, sends);
      EXPECT_EQ(c.forwards, 0u);  // every round's send waits for the round before, not a hop
      EXPECT_EQ(c.bytes_sent, sends * b);
      EXPECT_EQ(c.bytes_received, received * b);
      EXPECT_EQ(c.runs, runs);
    }
  }
}

TEST(ScalingCounts, RingMakesTwoNMinusOneHopsOfOneSegment) {
  constexpr int64_t kCount = 3 << 16;  // 768 KiB, above the small size: the ring; divisible by 8
  const uint64_t b = kCount * 4;
  for (int n : worlds()) {
    SCOPED_TRACE(testing::Message() << "world " << n);
    const auto cs = counts_of_one_allreduce(n, kCount);
    print("ring", n, b, cs);
    for (int r = 0; r < n; ++r) {
      SCOPED_TRACE(testing::Message() << "rank " << r);
      const Counts& c = cs[static_cast<size_t>(r)];
      EXPECT_EQ(c.sends, static_cast<uint64_t>(2 * (n - 1)));
      // Every hop but the first forwards what arrived: 2(n-1) - 1 dependent hand-offs per
      // rank, one run() (Note [Single-copy allreduce] in algorithms/single_copy.h: 3 runs
      // and no forwards at any world).
      EXPECT_EQ(c.forwards, static_cast<uint64_t>(2 * (n - 1) - 1));
      EXPECT_EQ(c.runs, 1u);
      EXPECT_EQ(c.bytes_sent, 2 * (n - 1) * b / n);
      EXPECT_EQ(c.bytes_received, 2 * (n - 1) * b / n);
    }
  }
}

}  // namespace
}  // namespace tdist::comm
