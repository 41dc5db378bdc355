#pragma once
// Reduce operations and per-operation options, named as in c10d (AllreduceOptions, ...).
// Every options struct carries `timeout`; kUseGroupTimeout means the group's default
// (ProcessGroup::Options::timeout).

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace tdist::comm {

using Millis = std::chrono::milliseconds;
inline constexpr Millis kUseGroupTimeout{-1};

// BAND/BOR/BXOR are for integer and bool tensors only. AVG divides the sum by the world size
// (floating-point and complex tensors; on integer tensors it is refused with InvalidArgument).
enum class ReduceOp : uint8_t { SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR };

const char* to_string(ReduceOp op);

struct AllreduceOptions {
  ReduceOp op = ReduceOp::SUM;
  Millis timeout = kUseGroupTimeout;
};
struct AllreduceCoalescedOptions : AllreduceOptions {};
struct BroadcastOptions {
  int root = 0;
  Millis timeout = kUseGroupTimeout;
};
struct ReduceOptions {
  ReduceOp op = ReduceOp::SUM;
  int root = 0;
  Millis timeout = kUseGroupTimeout;
};
struct AllgatherOptions {
  Millis timeout = kUseGroupTimeout;
};
struct GatherOptions {
  int root = 0;
  Millis timeout = kUseGroupTimeout;
};
struct ScatterOptions {
  int root = 0;
  Millis timeout = kUseGroupTimeout;
};
struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::SUM;
  Millis timeout = kUseGroupTimeout;
};
struct AllToAllOptions {
  Millis timeout = kUseGroupTimeout;
};
struct BarrierOptions {
  Millis timeout = kUseGroupTimeout;
};
struct SendRecvOptions {
  Millis timeout = kUseGroupTimeout;
};

}  // namespace tdist::comm
