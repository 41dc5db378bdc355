#pragma once
// The operations of a ProcessGroup as values: one struct per operation, and Call, any of them
// (Note [One operation table]).
//
// Note [One operation table]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// The operations of comm/process_group.h are listed once, here. Each public method of
// ProcessGroup (broadcast, allreduce, ...) builds its struct and hands it to the one virtual
// entry point, ProcessGroup::submit(Call). A backend implements submit() with std::visit over
// one function of its own per struct (a member template, start(), specialized per Call: the
// ring's op table, the NCCL backend's calls into ProcessGroupNCCL), so a backend that misses an
// operation does not build, and its header does not list the operations again; the dispatch
// (comm/device_dispatch.h) routes any Call by the device of its tensors (for_each_tensor) with
// no code per operation; and a stand-in (a test's fake group) answers the operations it does not
// model with one generic function. A new operation is a struct here, its alternative in Call,
// its method on ProcessGroup and its function in each backend.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <variant>
#include <vector>

#include "tdist/comm/types.h"

namespace tdist::comm {

struct BroadcastCall {
  static constexpr const char* kName = "broadcast";
  at::Tensor tensor;
  BroadcastOptions opts;
  template <class F>
  void for_each_tensor(F&& f) const {
    f(tensor);
  }
};

struct AllreduceCall {
  static constexpr const char* kName = "allreduce";
  at::Tensor tensor;
  AllreduceOptions opts;
  template <class F>
  void for_each_tensor(F&& f) const {
    f(tensor);
  }
};

struct AllreduceCoalescedCall {
  static constexpr const char* kName = "allreduce_coalesced";
  std::vector<at::Tensor> tensors;
  AllreduceCoalescedOptions opts;
  template <class F>
  void for_each_tensor(F&& f) const {
    for (const auto& t : tensors) f(t);
  }
};

struct ReduceCall {
  static constexpr const char* kName = "reduce";
  at::Tensor tensor;
  ReduceOptions opts;
  template <class F>
  void for_each_tensor(F&& f) const {
    f(tensor);
  }
};

// outputs: size() tensors shaped like input.
struct AllgatherCall {
  static constexpr const char* kName = "allgather";
  std::vector<at::Tensor> outputs;
  at::Tensor input;
  AllgatherOptions opts;
  template <class F>
  void for_each_tensor(F&& f) const {
    for (const auto& t : outputs) f(t);
    f(input);
  }
};

// output: size() * input.numel() elements (c10d's _allgather_base / all_gather_into_tensor).
struct AllgatherIntoTensorCall {
  static constexpr const char* kName = "allgather_into_tensor";
  at::Tensor output;
  at::Tensor input;
  AllgatherOptions opts;
  template <class F>
  void for_each_tensor(F&& f) const {
    f(output);
    f(input);
  }
};

// outputs: size() tensors on the root, empty elsewhere.
struct GatherCall {
  static constexpr const char* kName = "gather";
  std::vector<at::Tensor> outputs;
  at::Tensor input;
  GatherOptions opts;
  template <class F>
  void for_each_tensor(F&& f) const {
    for (const auto& t : outputs) f(t);
    f(input);
  }
};

// inputs: size() tensors on the root, empty elsewhere.
struct ScatterCall {
  static constexpr const char* kName = "scatter";
  at::Tensor output;
  std::vector<at::Tensor> inputs;
  ScatterOptions opts;
  template <class F>
  void for_each_tensor(F&& f) const {
    f(output);
    for (const auto& t : inputs) f(t);
  }
};

// inputs: size() tensors shaped like output.
struct ReduceScatterCall {
  static constexpr const char* kName = "reduce_scatter";
  at::Tensor output;
  std::vector<at::Tensor> inputs;
  ReduceScatterOptions opts;
  template <class F>
  void for_each_tensor(F&& f) const {
    f(output);
    for (const auto& t : inputs) f(t);
  }
};

// input: size() * output.numel() elements (c10d's _reduce_scatter_base).
struct ReduceScatterTensorCall {
  static constexpr const char* kName = "reduce_scatter_tensor";
  at::Tensor output;
  at::Tensor input;
  ReduceScatterOptions opts;
  template <class F>
  void for_each_tensor(F&& f) const {
    f(output);
    f(input);
  }
};

// Equal splits along dim 0 when the split lists are empty; otherwise row counts per rank.
struct AlltoallBaseCall {
  static constexpr const char* kName = "alltoall_base";
  at::Tensor output;
  at::Tensor input;
  std::vector<int64_t> output_splits;
  std::vector<int64_t> input_splits;
  AllToAllOptions opts;
  template <class F>
  void for_each_tensor(F&& f) const {
    f(output);
    f(input);
  }
};

// inputs: size() tensors, one for each rank; outputs: size() tensors, one from each rank.
struct AlltoallCall {
  static constexpr const char* kName = "alltoall";
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> inputs;
  AllToAllOptions opts;
  template <class F>
  void for_each_tensor(F&& f) const {
    for (const auto& t : outputs) f(t);
    for (const auto& t : inputs) f(t);
  }
};

struct BarrierCall {
  static constexpr const char* kName = "barrier";
  BarrierOptions opts;
  template <class F>
  void for_each_tensor(F&&) const {}
};

struct SendCall {
  static constexpr const char* kName = "send";
  at::Tensor tensor;
  int dst = 0;
  int tag = 0;
  SendRecvOptions opts;
  template <class F>
  void for_each_tensor(F&& f) const {
    f(tensor);
  }
};

struct RecvCall {
  static constexpr const char* kName = "recv";
  at::Tensor tensor;
  int src = 0;
  int tag = 0;
  SendRecvOptions opts;
  template <class F>
  void for_each_tensor(F&& f) const {
    f(tensor);
  }
};

struct RecvAnySourceCall {
  static constexpr const char* kName = "recv_any_source";
  at::Tensor tensor;
  int tag = 0;
  SendRecvOptions opts;
  template <class F>
  void for_each_tensor(F&& f) const {
    f(tensor);
  }
};

using Call = std::variant<BroadcastCall, AllreduceCall, AllreduceCoalescedCall, ReduceCall,
                          AllgatherCall, AllgatherIntoTensorCall, GatherCall, ScatterCall,
                          ReduceScatterCall, ReduceScatterTensorCall, AlltoallBaseCall,
                          AlltoallCall, BarrierCall, SendCall, RecvCall, RecvAnySourceCall>;

// The operation's name ("allreduce"), as its errors give it.
inline const char* call_name(const Call& call) {
  return std::visit([](const auto& c) { return c.kName; }, call);
}

// Calls f(const at::Tensor&) for every tensor the operation reads or writes.
template <class F>
void for_each_tensor(const Call& call, F&& f) {
  std::visit([&](const auto& c) { c.for_each_tensor(f); }, call);
}

}  // namespace tdist::comm
