// Every operation of the GPU test (every_op.h) on CPU tensors staged through the testing hook in
// its device-like mode: the copies in complete late and in a random order, the copies out late on
// another thread, as a GPU's do (StagingForTests). Same sizes as the GPU test (1 MiB pieces, 4 MiB
// blocks, 12 MiB allreduces), inputs that depend on the rank and on each element's position, so a
// block reduced from the wrong piece or landing at the wrong offset shows.
//
// Issue 40: on 4622ec6 the reduce-scatters larger than a window (3 MiB) gave wrong sums from their
// second window on at worlds 3 and 4, staged or not (Note [Reduce-scatter slots]); the GPU test saw
// it on an H200.

#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "tdist/comm/ring/staging.h"
#include "tests/comm/comm_test_util.h"
#include "tests/comm/cpu_staging.h"
#include "tests/comm/every_op.h"

namespace tdist::comm {
namespace {

// Parameters: world size, pieces (0: nothing staged) and window bytes.
class StagingEveryOp : public ::testing::TestWithParam<std::tuple<int, size_t, const char*>> {};

TEST_P(StagingEveryOp, GivesExactResultsWithCopiesLateAndUnordered) {
  const auto [world, piece, window] = GetParam();
  tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_WINDOW_BYTES", window}});
  CpuStaging on(piece, /*delay_us=*/300, /*strided=*/true, /*device_like=*/true);
  const size_t before = detail::staged_buffers_for_tests();
  tdist::test::spawn(world, [&, world = world](int rank, std::shared_ptr<Store> store) {
    test::check_every_op(create_process_group(store, rank, world, test::test_options()),
                         c10::Device(c10::kCPU));
  });
  const size_t staged = detail::staged_buffers_for_tests() - before;
  if (piece == 0) {
    EXPECT_EQ(staged, 0u);
  } else {
    EXPECT_GT(staged, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsPiecesWindows, StagingEveryOp,
                         ::testing::Combine(::testing::Values(2, 3, 4),
                                            ::testing::Values(size_t{1} << 20, size_t{0}),
                                            ::testing::Values("67108864", "3145728")),
                         [](const auto& info) {
                           return "world" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) == 0 ? "_unstaged" : "_staged") +
                                  "_window" + std::get<2>(info.param);
                         });

}  // namespace
}  // namespace tdist::comm
