#pragma once
// An RPC message as the agent, its handlers and its extension points (rpc/autograd_hooks.h) see
// it: a type, flags, the id that pairs a response with its request, the payload and the tensors.
// How a message travels (the frame header, the tensor section, the checks a receiver makes) is
// Note [RPC wire format] in rpc/detail/message.h.
//
// Plain data: no synchronization; a message belongs to one thread at a time.

#include <ATen/core/Tensor.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "tdist/core/store.h"

namespace tdist::rpc {

enum class MessageType : uint16_t {
  kCall = 1,              // run a registered function, reply with its result
  kResponse = 2,          // a request's result
  kError = 3,             // a request's failure: message and worker name
  kRemoteCall = 4,        // run a function or constructor into a new OwnerRRef
  kRRefFetch = 5,         // to_here(): the owner replies with the value
  kRRefMethodCall = 6,    // run a registered method on an RRef's value, reply with its result
  kRRefMethodRemote = 7,  // run a method into a new OwnerRRef on the same owner
  kRRefForkRequest = 8,   // a user tells the owner about a new fork
  kRRefUserDelete = 9,    // a user tells the owner that a fork is gone
  kRRefChildAccept = 10,  // a child tells its parent that the owner knows it
  kTensorRelease = 11,    // the receiver has read the sender's remote tensors of frame `id`
  kShmRelease = 12,       // the receiver is done with the sender's shared-memory slot `id`
  // Frames leave TCP for a shared-memory ring (Note [RPC shared-memory frame streams] in
  // rpc/detail/shm_stream.h); `id` is the ring's tag.
  kStreamOffer = 13,   // body: StreamOffer
  kStreamAccept = 14,  // the offer's receiver mapped the ring
  kStreamSwitch = 15,  // the last frame of the socket: the rest come through the ring
  kMaxType = 15,
};

constexpr size_t kHeaderSize = 40;  // the frame prefix (Note [Frame prefix]) and 32 more bytes

// The payload starts with distributed autograd's header (rpc/autograd_hooks.h), which the hooks
// write and strip; the other flags belong to the framing (rpc/detail/message.h).
constexpr uint32_t kFlagAutograd = 1u << 2;

// A received message.
struct Message {
  MessageType type = MessageType::kCall;
  uint32_t flags = 0;
  uint64_t id = 0;
  Bytes body;  // the payload, without the tensor section
  std::vector<at::Tensor> tensors;
  int from = -1;  // the sender's rank
};

// A message to send. The connection adds the tensor section and the header.
struct OutMessage {
  MessageType type = MessageType::kCall;
  uint32_t flags = 0;
  uint64_t id = 0;
  Bytes body;  // the payload
  std::vector<at::Tensor> tensors;

  // Filled by the connection when it frames the message.
  std::array<uint8_t, kHeaderSize> header{};
  uint64_t tensor_bytes = 0;
};

}  // namespace tdist::rpc
