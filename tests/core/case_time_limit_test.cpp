// The per-case time limit of a test process that runs many cases (Note [Case time limit] in
// tests/harness/case_time_limit.h): the watchdog alone, then a real shard-like run of this
// binary whose case hangs with a child process.
#include "tests/harness/case_time_limit.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/harness/command.h"
#include "tests/harness/env_guard.h"
#include "tests/harness/process.h"

namespace tdist::test {
namespace {

using std::chrono::milliseconds;

// What a CaseTimeLimit's expiry action saw, in order.
struct Expiries {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> names;
  std::vector<milliseconds> limits;

  CaseTimeLimit::OnExpire action() {
    return [this](const std::string& name, milliseconds limit) {
      std::lock_guard<std::mutex> lock(mu);
      names.push_back(name);
      limits.push_back(limit);
      cv.notify_all();
    };
  }
  // Waits (up to a minute: a bound for a loaded machine, not a measured time) for `n` expiries.
  bool wait_for(size_t n) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(60), [&] { return names.size() >= n; });
  }
};

TEST(CaseTimeLimit, ACaseThatRunsPastItsLimitIsNamedWithTheLimit) {
  Expiries seen;
  CaseTimeLimit limit(milliseconds(50), seen.action());
  limit.arm("Suite.Hangs");
  ASSERT_TRUE(seen.wait_for(1)) << "the watchdog never fired";
  std::lock_guard<std::mutex> lock(seen.mu);
  EXPECT_EQ(seen.names, std::vector<std::string>{"Suite.Hangs"});
  EXPECT_EQ(seen.limits, std::vector<milliseconds>{milliseconds(50)});
}

TEST(CaseTimeLimit, ACaseDisarmedInTimeIsNeverBlamedAndTheNextCaseIsTimedAfresh) {
  Expiries seen;
  CaseTimeLimit limit(milliseconds(200), seen.action());
  for (int i = 0; i < 5; ++i) {
    limit.arm("Suite.EndsInTime" + std::to_string(i));
    limit.disarm();
  }
  limit.arm("Suite.Hangs");
  ASSERT_TRUE(seen.wait_for(1)) << "the watchdog never fired";
  std::lock_guard<std::mutex> lock(seen.mu);
  EXPECT_EQ(seen.names, std::vector<std::string>{"Suite.Hangs"});
}

TEST(CaseTimeLimit, TheEnvironmentGivesWholePositiveSecondsOrAClearError) {
  {
    EnvGuard env(EnvVars{{"TDIST_TEST_CASE_TIMEOUT", std::nullopt}});
    EXPECT_EQ(case_timeout_from_env(), 0);
  }
  {
    EnvGuard env(EnvVars{{"TDIST_TEST_CASE_TIMEOUT", "120"}});
    EXPECT_EQ(case_timeout_from_env(), 120);
  }
  for (const char* bad : {"abc", "0", "-5", "12s", "1e9"}) {
    EnvGuard env(EnvVars{{"TDIST_TEST_CASE_TIMEOUT", std::string(bad)}});
    try {
      case_timeout_from_env();
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("TDIST_TEST_CASE_TIMEOUT"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
}

TDIST_TEST_CHILD(case_time_limit_sleeper) {
  while (true) ::pause();
  return 0;
}

// The probe that CaseTimeLimit.AHungCaseEndsItsShardNamingItselfAndItsChildrenDie runs in a
// process of its own: it starts a child, writes the child's pid, and hangs.
TEST(CaseTimeLimitProbe, HangsWithAChild) {
  const char* pid_file = std::getenv("TDIST_CASE_TIME_LIMIT_PROBE");
  if (pid_file == nullptr) {
    GTEST_SKIP()
        << "the probe of CaseTimeLimit.AHungCaseEndsItsShardNamingItselfAndItsChildrenDie, "
           "which runs it in a process of its own";
  }
  Processes child("case_time_limit_sleeper", 1);
  {
    std::ofstream out(pid_file);
    out << child.pid(0) << "\n";
  }
  while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
}

// A process's state letter from /proc/<pid>/stat, or 0 when the process is gone.
char probe_child_state(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return 0;
  const auto paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() ? 0 : line[paren + 2];
}

TEST(CaseTimeLimit, AHungCaseEndsItsShardNamingItselfAndItsChildrenDie) {
  const std::string pid_file = temp_dir("tdist-case-limit") + "/child.pid";
  // One shard of one (a shard's own GTEST_SHARD_* would otherwise pick the cases again).
  CommandResult r =
      run_command({"/proc/self/exe", "--gtest_filter=CaseTimeLimitProbe.HangsWithAChild"},
                  with_timeout(120, {{"TDIST_TEST_CASE_TIMEOUT", "1"},
                                     {"TDIST_CASE_TIME_LIMIT_PROBE", pid_file},
                                     {"GTEST_SHARD_INDEX", "0"},
                                     {"GTEST_TOTAL_SHARDS", "1"}}));
  ASSERT_FALSE(r.timed_out) << "the hung case outlived its limit: " << r.describe();
  EXPECT_TRUE(r.exited && r.exit_code == 1) << r.describe();
  EXPECT_NE(r.err.find("[  TIMEOUT ] CaseTimeLimitProbe.HangsWithAChild ran past its limit of 1 s"),
            std::string::npos)
      << r.describe();
  EXPECT_EQ(r.out.find("[  PASSED  ]"), std::string::npos) << r.describe();

  std::ifstream in(pid_file);
  pid_t child = 0;
  ASSERT_TRUE(in >> child) << "the probe never started its child: " << r.describe();
  // SIGKILLed before the probe exited; once reparented it is gone or a zombie (state Z) that
  // init has not reaped yet.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  char state = probe_child_state(child);
  while (state != 0 && state != 'Z' && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(20));
    state = probe_child_state(child);
  }
  EXPECT_TRUE(state == 0 || state == 'Z')
      << "child " << child << " still runs (state " << state << ")";
  if (state != 0 && state != 'Z') ::kill(child, SIGKILL);
}

TEST(CaseTimeLimit, ABadLimitStopsTheBinaryBeforeAnyCaseWithAClearError) {
  CommandResult r = run_command({"/proc/self/exe", "--gtest_filter=CaseTimeLimit.*Named*"},
                                with_timeout(60, {{"TDIST_TEST_CASE_TIMEOUT", "soon"}}));
  ASSERT_FALSE(r.timed_out) << r.describe();
  EXPECT_TRUE(r.exited && r.exit_code == 2) << r.describe();
  EXPECT_NE(r.err.find("TDIST_TEST_CASE_TIMEOUT must be a whole number of seconds"),
            std::string::npos)
      << r.describe();
  EXPECT_EQ(r.out.find("[ RUN      ]"), std::string::npos) << r.describe();
}

}  // namespace
}  // namespace tdist::test
