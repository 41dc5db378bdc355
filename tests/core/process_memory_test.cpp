// core/process_memory.h: reading a local process's memory, and the probe that tells whether the
// kernel lets us read a process at all.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "tdist/core/error.h"
#include "tdist/core/process_memory.h"

namespace tdist {
namespace {

// A child process that exits at once and is reaped: its pid then names no process.
pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

TEST(ProcessMemory, ReadsThisProcessAndTheProbeSaysSo) {
  std::vector<char> src(3 << 20);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 7);
  std::vector<char> dst(src.size());
  read_process_memory(::getpid(), reinterpret_cast<uint64_t>(src.data()), dst.data(), dst.size());
  EXPECT_EQ(dst, src);
  EXPECT_TRUE(can_read_process(::getpid()));
}

TEST(ProcessMemory, NoProcessFailsTheProbe) {
  EXPECT_FALSE(can_read_process(dead_pid()));
  EXPECT_FALSE(can_read_process(0));
  EXPECT_FALSE(can_read_process(-1));
}

TEST(ProcessMemory, FailuresSayWhyAndTouchNothing) {
  char dst[16] = "untouched";
  EXPECT_EQ(try_read_process_memory(dead_pid(), reinterpret_cast<uint64_t>(dst), dst, 8), ESRCH);
  EXPECT_EQ(try_read_process_memory(::getpid(), 0, dst, 8), EFAULT);
  EXPECT_STREQ(dst, "untouched");
  try {
    read_process_memory(::getpid(), 8, dst, 8);
    FAIL() << "reading an unmapped address did not throw";
  } catch (const NetworkError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("process " + std::to_string(::getpid())), std::string::npos) << what;
    EXPECT_NE(what.find(std::strerror(EFAULT)), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace tdist
