#pragma once
// Assertion helpers shared by the test files.
#include <gtest/gtest.h>

#include <string>

namespace tdist::test {

// Runs fn and returns the message of the E it throws; records a failure (and returns "") when it
// throws something else or nothing.
template <typename E, typename Fn>
std::string expect_throw(Fn fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "unexpected exception type: " << e.what();
    return {};
  }
  ADD_FAILURE() << "no exception thrown";
  return {};
}

inline void expect_contains(const std::string& text, const std::string& fragment) {
  EXPECT_NE(text.find(fragment), std::string::npos) << "'" << fragment << "' not in: " << text;
}

}  // namespace tdist::test
