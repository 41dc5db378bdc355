#pragma once
// Collectives DDP runs on the model itself (not on gradients): checking that every rank holds
// the same model, and broadcasting parameters and buffers from one rank.
// Both are collectives: every rank of the group calls them at the same point. They block until
// done or `timeout` passes.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <string>
#include <vector>

namespace tdist::comm {
class ProcessGroup;
}

namespace tdist::ddp {

// One entry per parameter (or buffer): its name, dtype and shape.
struct TensorSignature {
  std::string kind;  // "parameter" or "buffer"
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;

  bool operator==(const TensorSignature& o) const {
    return kind == o.kind && name == o.name && dtype == o.dtype && shape == o.shape;
  }
  std::string describe() const;  // "parameter fc1.weight: Float [4, 3]"
};

TensorSignature signature_of(std::string kind, std::string name, const at::Tensor& t);

// Throws InvalidArgument on every rank when any rank's list differs from rank 0's, naming the
// first differing entry, what each side has, and the ranks that differ.
void verify_same_across_ranks(comm::ProcessGroup& pg, const std::vector<TensorSignature>& mine,
                              std::chrono::milliseconds timeout);

// Overwrites `tensors` on every rank with root's values (coalesced: one broadcast per device,
// dtype and chunk of at most 64 MiB). Runs under NoGradGuard, so parameters may be passed.
void broadcast_coalesced(comm::ProcessGroup& pg, const std::vector<at::Tensor>& tensors, int root,
                         std::chrono::milliseconds timeout);

}  // namespace tdist::ddp
