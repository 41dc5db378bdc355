#pragma once
// Distributed autograd's header on RPC frames: its layout, its encoder and its checked decoder.
// Internal to tdist::autograd (autograd/hooks.cpp writes and reads it). A unit of its own, with
// no state of autograd's, so that the fuzz target over the decoder
// (tests/fuzz/autograd_header_fuzz.cpp) builds without the rest of the module.
//
// Note [Autograd frame header]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A frame with kFlagAutograd starts its payload with (little-endian)
//
//   i64 context_id | i64 message_id | u32 count | count x u32 tensor index
//
// context_id: the context the message belongs to (> 0, its creator's rank in the top 16 bits).
// message_id: the sender's autograd message id of its SendRpcBackward, or -1 when no tensor of
// the message requires grad (count == 0). The indices, strictly increasing and below the
// message's tensor count, name the tensors that required grad on the sender; the receiver
// gives exactly those a RecvRpcBackward. Requests of the call types (CALL, REMOTE_CALL,
// RREF_FETCH, RREF_METHOD_CALL/REMOTE) made inside a context always carry the header, so that
// the callee runs in the context and its nested calls and its result are recorded; a response
// carries it only when its result holds tensors that require grad. Anything else is refused
// (ProtocolError) before a handler runs.
//
// Thread safety: free functions over the message they are given; no shared state.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tdist/rpc/message.h"

namespace tdist::autograd::detail {

// The creator's rank sits in the top 16 bits of a context id.
constexpr int kContextRankShift = 48;
inline int context_creator(int64_t context_id) {
  return static_cast<int>(context_id >> kContextRankShift);
}

// context_id, message_id and count; each index adds 4 bytes.
constexpr size_t kFixedHeaderSize = 8 + 8 + 4;

struct Header {
  int64_t context_id = 0;
  int64_t message_id = -1;
  std::vector<uint32_t> indices;
};

// Writes h in front of m's payload and sets kFlagAutograd.
void prepend_header(rpc::OutMessage& m, const Header& h);

// Reads the header at the front of m's payload, checks it against the world size and m's
// tensors, and strips it. ProtocolError for anything inconsistent.
Header take_header(rpc::Message& m, int world_size);

}  // namespace tdist::autograd::detail
