// Nothing lost or leaked: after a process group is destroyed, gracefully or after an abort,
// this process holds no more threads, descriptors, shared-memory files or mappings than before,
// counted from /proc and /dev/shm. The first round warms up what lives for the whole process
// (libtorch's thread pools, the logger); every later round must end where the first ended.

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ctime>
#include <fstream>
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

// A process killed between creating a segment and its peer's open leaves /dev/shm/tdist-<pid>-*
// behind; the next group started on the host removes it, but nothing of a live process and
// nothing younger than a minute (another PID namespace's negotiation may be under way).
TEST(Leaks, TheNextGroupSweepsSegmentsOfDeadProcesses) {
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);  // `child` names no process now
  const std::string dead_old = str("/dev/shm/tdist-", child, "-0-1-sweeptest");
  const std::string dead_new = str("/dev/shm/tdist-", child, "-0-2-sweeptest");
  const std::string live_old = str("/dev/shm/tdist-", ::getpid(), "-0-1-sweeptest");
  for (const auto& f : {dead_old, dead_new, live_old}) std::ofstream(f) << "x";
  const timespec two_minutes_ago[2] = {{::time(nullptr) - 120, 0}, {::time(nullptr) - 120, 0}};
  ::utimensat(AT_FDCWD, dead_old.c_str(), two_minutes_ago, 0);
  ::utimensat(AT_FDCWD, live_old.c_str(), two_minutes_ago, 0);
  one_group(false);
  EXPECT_NE(::access(dead_old.c_str(), F_OK), 0) << "a dead process's old segment was left";
  EXPECT_EQ(::access(dead_new.c_str(), F_OK), 0) << "a young segment was removed";
  EXPECT_EQ(::access(live_old.c_str(), F_OK), 0) << "a live process's segment was removed";
  for (const auto& f : {dead_old, dead_new, live_old}) ::unlink(f.c_str());
}

}  // namespace
}  // namespace tdist::comm
