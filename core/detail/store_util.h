#pragma once
// Helpers shared by the Store implementations.

#include <chrono>
#include <string>
#include <vector>

#include "tdist/core/store.h"

namespace tdist::detail {

// "a, b, c" (for error messages).
std::string join_keys(const std::vector<std::string>& keys);

// Seconds with up to three decimals, e.g. "0.25", "30".
std::string seconds_text(Millis timeout);

// Parses the decimal text that add() stores; throws InvalidArgument naming the key otherwise.
int64_t parse_counter(const std::string& key, const Bytes& value);

// The TimeoutError every store throws when a wait runs out: names the store, the keys and
// the seconds.
[[noreturn]] void throw_wait_timeout(const std::string& store,
                                     const std::vector<std::string>& missing, Millis timeout);

// Timeouts longer than this (about 35 years) mean "none": longer ones would overflow the clocks'
// nanosecond arithmetic (found by tests/fuzz/store_server).
inline constexpr Millis kLongestTimeout{int64_t(1) << 40};
// `timeout` as the stores treat it: above kLongestTimeout, kNoTimeout.
inline Millis effective_timeout(Millis timeout) {
  return timeout > kLongestTimeout ? Store::kNoTimeout : timeout;
}

// Deadline for a wait; `timeout` zero (or past kLongestTimeout) means none (time_point::max()).
std::chrono::steady_clock::time_point deadline_after(Millis timeout);

}  // namespace tdist::detail
