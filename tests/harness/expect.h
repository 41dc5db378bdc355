#pragma once
// Assertion helpers shared by the test files.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <initializer_list>
#include <string>

#include "tdist/core/error.h"

namespace tdist::test {

// How long a test's store and connection calls may wait: long enough for a loaded CI machine;
// only failures ever wait for it.
inline constexpr std::chrono::milliseconds kTimeout{20000};

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

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Records a failure unless fn throws InvalidArgument whose message holds every one of `parts`.
inline void expect_invalid(const std::function<void()>& fn,
                           std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    for (const auto& p : parts) expect_contains(e.what(), p);
  }
}

}  // namespace tdist::test
