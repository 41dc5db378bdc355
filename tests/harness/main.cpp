// main() of every tdist test binary: dispatches process-harness children, then runs GoogleTest,
// with a time limit per case when TDIST_TEST_CASE_TIMEOUT asks for one (Note [Case time limit]
// in tests/harness/case_time_limit.h).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <stdexcept>

#include "tests/harness/case_time_limit.h"
#include "tests/harness/process.h"

int main(int argc, char** argv) {
  int child = tdist::test::run_child_if_requested();
  if (child >= 0) return child;
  ::testing::InitGoogleTest(&argc, argv);
  int seconds = 0;
  try {
    seconds = tdist::test::case_timeout_from_env();
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  std::unique_ptr<tdist::test::CaseTimeLimit> limit;
  ::testing::TestEventListener* listener = nullptr;
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (seconds > 0) {
    limit = std::make_unique<tdist::test::CaseTimeLimit>(std::chrono::seconds(seconds));
    listener = tdist::test::case_time_limit_listener(*limit).release();
    listeners.Append(listener);  // GoogleTest owns it until Release
  }
  int rc = RUN_ALL_TESTS();
  if (listener != nullptr) delete listeners.Release(listener);
  limit.reset();
  tdist::test::remove_temp_dirs();
  return rc;
}
