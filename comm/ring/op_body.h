#pragma once
// OpBody: what one queued operation of the ring backend does, as RingProcessGroup's op table
// describes it (ring_process_group_ops.cpp) and runs it (RingProcessGroup::run); the OpQueue
// (op_queue.h) carries it without looking inside.

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "tdist/comm/algorithms/context.h"
#include "tdist/comm/engine/fingerprint.h"
#include "tdist/comm/work.h"

namespace tdist::comm::detail {

// The small operations whose arguments the body keeps itself rather than in a capturing Run
// (which would allocate): Note [Small operations] in op_queue.cpp.
enum class OpKind {
  kRun,                  // body.run
  kAllreduce,            // `work` reduced in place
  kBroadcast,            // `work` from args.root
  kAllgatherInto,        // `in` (this rank's block) into `work`, one block per rank
  kAllgatherList,        // `in` into `list` (one contiguous host tensor per rank)
  kReduceScatterTensor,  // `in` (one block per rank) reduced into `work`
  kReduceScatterList,    // `list` (one contiguous host tensor per rank) reduced into `work`
};

struct SmallArgs {
  at::Tensor orig;  // the caller's tensor (the output, where the op has one)
  at::Tensor work;  // its contiguous host values (orig itself when it is one)
  at::Tensor in;    // the contiguous host values of an allgather's or reduce-scatter's input
  std::vector<at::Tensor> list;  // the caller's list, moved in (given back as the result)
  algorithms::ReduceSpec rs{};
  int root = 0;
};

struct OpBody {
  using Run = std::function<Future::Value(algorithms::Context&)>;
  OpKind kind = OpKind::kRun;
  Run run;         // kRun only
  SmallArgs args;  // every other kind
  // Checked against the peers' before the operation runs when the group has TDIST_DEBUG=DETAIL
  // (Note [Fingerprint check]); its op and seq are filled in then.
  Fingerprint fingerprint;
};

}  // namespace tdist::comm::detail
