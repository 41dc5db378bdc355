#pragma once
// How call arguments and results are written: core/serialize.h's archives (Note [Wire
// serialization]) with RPC's contexts. The layout and the bounded decoding are those of every
// wire message; what the contexts add are the two types that travel differently in a call
// (Note [RPC wire format] in message.h):
//   - an at::Tensor is its index in the message's tensor list (kUndefinedTensor for an undefined
//     one); its bytes travel beside the frame (scatter-gather on send, read straight into the new
//     tensor on receipt);
//   - an RRef is written as fork data, and writing or reading one runs the RRef protocol
//     (Note [RRef protocol], rpc/rref.h), so the contexts carry the RRef context and the peer's
//     rank.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "tdist/core/serialize.h"

namespace tdist::rpc::detail {

class RRefContext;

// What encoding one outgoing message needs besides the bytes.
struct SendContext {
  std::vector<at::Tensor>* tensors = nullptr;  // the message's tensors, in index order
  RRefContext* rrefs = nullptr;
  int dest_rank = -1;
  bool has_rrefs = false;  // set when an RRef was written (the receiver decodes on a pool thread)
};

// What decoding one incoming message needs besides the bytes.
struct RecvContext {
  const std::vector<at::Tensor>* tensors = nullptr;
  RRefContext* rrefs = nullptr;
  int from_rank = -1;
};

using ArgOutputArchive = WireOutputArchive<SendContext>;
using ArgInputArchive = WireInputArchive<RecvContext>;

constexpr uint32_t kUndefinedTensor = std::numeric_limits<uint32_t>::max();

void save_tensor(ArgOutputArchive& ar, const at::Tensor& t);
void load_tensor(ArgInputArchive& ar, at::Tensor& t);

// Found by argument-dependent lookup on the context's namespace.
inline void CEREAL_SAVE_FUNCTION_NAME(ArgOutputArchive& ar, const at::Tensor& t) {
  save_tensor(ar, t);
}
inline void CEREAL_LOAD_FUNCTION_NAME(ArgInputArchive& ar, at::Tensor& t) { load_tensor(ar, t); }

}  // namespace tdist::rpc::detail

CEREAL_REGISTER_ARCHIVE(tdist::rpc::detail::ArgOutputArchive)
CEREAL_REGISTER_ARCHIVE(tdist::rpc::detail::ArgInputArchive)
CEREAL_SETUP_ARCHIVE_TRAITS(tdist::rpc::detail::ArgInputArchive,
                            tdist::rpc::detail::ArgOutputArchive)
