#include <gtest/gtest.h>

#include "tdist/core/error.h"
#include "tdist/core/logging.h"

namespace tdist {
namespace {

TEST(Error, CheckNamesFileLineAndMessage) {
  try {
    int x = 3;
    TDIST_CHECK(x == 4, "x was ", x);
    FAIL() << "no throw";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("x == 4"), std::string::npos) << what;
    EXPECT_NE(what.find("x was 3"), std::string::npos) << what;
    EXPECT_NE(what.find("error_test.cpp:"), std::string::npos) << what;
  }
}

TEST(Error, CheckEqPrintsBothValues) {
  int a = 1, b = 2;
  try {
    TDIST_CHECK_EQ(a, b, "sizes differ");
    FAIL() << "no throw";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("(1 vs 2)"), std::string::npos) << what;
    EXPECT_NE(what.find("sizes differ"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(TDIST_CHECK_EQ(a, 1));
  EXPECT_NO_THROW(TDIST_CHECK_LT(a, b));
  EXPECT_THROW(TDIST_CHECK_GT(a, b), Error);
}

TEST(Error, SubclassesAreCatchableAsError) {
  EXPECT_THROW(TDIST_CHECK_ARG(false, "bad"), InvalidArgument);
  EXPECT_THROW(TDIST_THROW(TimeoutError, "late"), Error);
  EXPECT_THROW(TDIST_THROW(NetworkError, "gone"), NetworkError);
  EXPECT_THROW(TDIST_THROW(ProtocolError, "garbage"), std::runtime_error);
}

TEST(Logging, ParsesLevelsAndRejectsBadOnes) {
  EXPECT_EQ(parse_log_level("DEBUG"), LogLevel::kDebug);
  EXPECT_EQ(parse_log_level("warning"), LogLevel::kWarn);
  EXPECT_EQ(parse_log_level("off"), LogLevel::kOff);
  EXPECT_THROW(parse_log_level("loud"), InvalidArgument);
}

TEST(Logging, LinesCarryTheRank) {
  set_log_level(LogLevel::kInfo);
  set_log_rank(7);
  testing::internal::CaptureStderr();
  TDIST_LOG_INFO("hello ", 42);
  TDIST_LOG_DEBUG("hidden");
  std::string out = testing::internal::GetCapturedStderr();
  set_log_level(LogLevel::kWarn);
  EXPECT_NE(out.find("[rank 7]"), std::string::npos) << out;
  EXPECT_NE(out.find("hello 42"), std::string::npos) << out;
  EXPECT_EQ(out.find("hidden"), std::string::npos) << out;
}

}  // namespace
}  // namespace tdist
