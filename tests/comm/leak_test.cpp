// Nothing lost or leaked: after a process group is destroyed, gracefully or after an abort,
// this process holds no more threads, descriptors, shared-memory files or mappings than before,
// counted from /proc and /dev/shm (the rings are memfds: they have no file there, and a group
// must not leave one). The first round warms up what lives for the whole process
// (libtorch's thread pools, the logger); every later round must end where the first ended.

#include <unistd.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "tests/comm/comm_test_util.h"
#include "tests/harness/proc_counts.h"

namespace tdist::comm {
namespace {

using tdist::test::held;

// One group of 2 (shared memory and TCP between its ranks) doing a small and a large allreduce,
// then destroyed; with `abort_it`, rank 1 aborts while rank 0 waits in an allreduce.
void one_group(bool abort_it) {
  tdist::test::spawn(2, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 2, test::test_options());
    pg->allreduce(torch::ones({16}))->wait();
    pg->allreduce(torch::ones({1 << 18}))->wait();
    // What the counters must see come and go: the ranks' rings are mapped now.
    EXPECT_GT(held().shm_maps, 0) << "the group does not use shared memory: nothing is checked";
    if (abort_it) {
      if (rank == 1) {
        pg->abort();
      } else {
        EXPECT_THROW(pg->allreduce(torch::ones({16}))->wait(Millis(30000)), Error);
      }
    } else {
      pg->barrier()->wait();
    }
    pg.reset();
  });
}

void expect_nothing_left(bool abort_it) {
  tdist::test::expect_rounds_leave_nothing([&] { one_group(abort_it); });
}

TEST(Leaks, AGracefullyDestroyedGroupLeavesNoThreadDescriptorOrSegment) {
  expect_nothing_left(false);
}

TEST(Leaks, AnAbortedGroupLeavesNoThreadDescriptorOrSegment) { expect_nothing_left(true); }

}  // namespace
}  // namespace tdist::comm
