#pragma once
// Time left until a deadline, for the RPC agent's bounded waits (at least 1 ms, so that a wait
// with it never means "no limit").

#include <algorithm>
#include <chrono>

#include "tdist/rpc/types.h"

namespace tdist::rpc::detail {

inline Millis remaining(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
  return std::max(left, Millis(1));
}

}  // namespace tdist::rpc::detail
