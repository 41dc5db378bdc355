// main() of every tdist test binary: dispatches process-harness children, then runs GoogleTest.
#include <gtest/gtest.h>

#include "tests/harness/process.h"

int main(int argc, char** argv) {
  int child = tdist::test::run_child_if_requested();
  if (child >= 0) return child;
  ::testing::InitGoogleTest(&argc, argv);
  int rc = RUN_ALL_TESTS();
  tdist::test::remove_temp_dirs();
  return rc;
}
