#pragma once
// RPC messages and their framing.
//
// Note [RPC wire format]
// ~~~~~~~~~~~~~~~~~~~~~~
// A connection carries frames. Each frame is a fixed 40-byte header, a body and the tensor bytes:
//
//   header  u32 magic "TRPC" | u16 version | u16 type | u32 flags | u32 body_len | u32 meta_len |
//           u32 reserved (0) | u64 id | u64 length            (little-endian)
//           (the first 8 bytes are the prefix of every tdist frame: Note [Frame prefix] in
//           core/net/frame.h)
//   body    body_len bytes = payload (body_len - meta_len bytes) + tensor section (meta_len bytes)
//   tensors length - body_len bytes: every tensor's bytes, in order, contiguous row-major
//
// `length` counts everything after the header. The payload is the message's fields followed by
// the call's arguments or result, all written with core/serialize.h's archive; the arguments and
// the result with RPC's context (rpc/detail/archive.h: tensors there are indices into the tensor
// section). With kFlagAutograd the
// payload starts with distributed autograd's header (rpc/autograd_hooks.h), stripped on receipt. The tensor section
// is a cereal TensorSection: one TensorMeta per tensor and, with kFlagRemoteTensors, the address
// of each tensor's bytes in the sender's memory instead of bytes in the frame (same-host fast
// path, see connection.h), the shared-memory slot that holds each such tensor (if any) and the
// slots the sender retired (Note [RPC shared-memory slots] in rpc/detail/shm_tensors.h).
//
// A receiver checks, before it allocates or reads anything that depends on them: the magic, the
// version, a known type, length <= the maximum frame size, meta_len <= body_len <= length,
// reserved == 0; then that the tensor section decodes within meta_len bytes, that every TensorMeta
// is valid (core/tensor_wire.h) and that the tensor byte counts add up to exactly
// length - body_len. Any violation closes the connection (ProtocolError). Even then the lengths
// are only the peer's word: the body and each tensor's storage grow as their bytes arrive
// (rpc/detail/tensor_pool.h), so a peer makes a receiver hold about twice what it sent, never
// what it announced.
//
// `id` pairs a response (kResponse / kError) with its request. Every other type but
// kTensorRelease, kShmRelease (no body; `id` names a frame or a slot) and the three stream
// frames (the connection's own, `id` names a ring) is a request and gets exactly one response.

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "tdist/core/net/frame.h"
#include "tdist/core/store.h"
#include "tdist/core/tensor_wire.h"
#include "tdist/rpc/message.h"

namespace tdist::rpc::detail {

using rpc::kFlagAutograd;
using rpc::kHeaderSize;
using rpc::Message;
using rpc::MessageType;
using rpc::OutMessage;

const char* message_type_name(MessageType type);
// The frames that move a connection onto a shared-memory ring (check_stream_frame).
inline bool is_stream_frame(MessageType t) {
  return t == MessageType::kStreamOffer || t == MessageType::kStreamAccept ||
         t == MessageType::kStreamSwitch;
}
// Frames the connection handles itself: never handed to the agent.
inline bool is_connection_frame(MessageType t) {
  return t == MessageType::kTensorRelease || t == MessageType::kShmRelease || is_stream_frame(t);
}
inline bool is_request(MessageType t) {
  return t != MessageType::kResponse && t != MessageType::kError && !is_connection_frame(t);
}

constexpr uint32_t kMagic = 0x43505254;  // "TRPC"
constexpr uint16_t kVersion = 1;
constexpr net::FrameProtocol kProtocol{kMagic, kVersion, "tdist RPC"};

constexpr uint32_t kFlagHasRRefs = 1u << 0;       // decode on a worker thread (runs the protocol)
constexpr uint32_t kFlagRemoteTensors = 1u << 1;  // tensor bytes stay in the sender's memory
constexpr uint32_t kKnownFlags = kFlagHasRRefs | kFlagRemoteTensors | kFlagAutograd;

struct FrameHeader {
  MessageType type = MessageType::kCall;
  uint32_t flags = 0;
  uint32_t body_len = 0;
  uint32_t meta_len = 0;
  uint64_t id = 0;
  uint64_t length = 0;
};

void encode_header(const FrameHeader& h, uint8_t* out /* kHeaderSize bytes */);
// Validates everything the header alone can tell (see the Note); ProtocolError otherwise.
FrameHeader decode_header(const uint8_t* in /* kHeaderSize bytes */, uint64_t max_frame_bytes);

// A shared-memory slot's name in a frame (Note [RPC shared-memory slots] in
// rpc/detail/shm_tensors.h): the memfd's descriptor number in the sender and the slot's tag;
// tag 0: this tensor is not in a slot.
struct ShmRef {
  int32_t fd = -1;
  uint64_t tag = 0;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(fd, tag);
  }
};

// The body of kStreamOffer: the ring's memfd descriptor number in the sender and its capacity.
struct StreamOffer {
  int32_t fd = -1;
  uint64_t capacity = 0;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(fd, capacity);
  }
};

// Checks the shape of a kStreamOffer, kStreamAccept or kStreamSwitch frame (only the offer has a
// body, of at most kMaxStreamOfferBytes, no tensors) and decodes the offer's body (`body`: its
// h.body_len bytes; empty for the others). ProtocolError otherwise.
StreamOffer check_stream_frame(const FrameHeader& h, const Bytes& body);
constexpr uint32_t kMaxStreamOfferBytes = 64;

struct TensorSection {
  std::vector<TensorMeta> metas;
  std::vector<uint64_t> addresses;  // kFlagRemoteTensors only
  std::vector<ShmRef> shm;          // kFlagRemoteTensors only: one per tensor, or none
  std::vector<uint64_t> retired;    // kFlagRemoteTensors only: slots the sender dropped

  template <class Archive>
  void serialize(Archive& ar) {
    ar(metas, addresses, shm, retired);
  }
};

// The tensor section at the end of a frame's body (its last h.meta_len bytes), decoded; `body`
// keeps the payload only. An empty section when meta_len is 0. ProtocolError when it does not
// decode within meta_len bytes. `body` holds the frame's h.body_len body bytes.
TensorSection take_tensor_section(const FrameHeader& h, Bytes& body);

// Checks a received tensor section against its frame header before any tensor is allocated
// (Note [RPC wire format]): addresses, when there are any, one per tensor and only with
// kFlagRemoteTensors and `accept_remote` (the same-host fast path is on); slot names likewise,
// each slot tensor with an address, and at most kMaxRetired retired slots; every TensorMeta
// valid; the bytes of the tensors in the frame (address 0, or no addresses) adding up to exactly
// h.length - h.body_len, those of the remote ones to at most max_frame_bytes. ProtocolError
// otherwise.
void check_tensor_section(const FrameHeader& h, const TensorSection& section, bool accept_remote,
                          uint64_t max_frame_bytes);
constexpr size_t kMaxRetired = 4096;

// Fields of the various messages (at the start of the payload, written without a context).
struct CallHeader {  // kCall, kRemoteCall (+ rref/fork), kRRefMethodCall/Remote (+ target)
  std::string name;
  uint64_t signature = 0;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(name, signature);
  }
};

struct ErrorBody {  // kError
  std::string message;
  std::string worker;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(message, worker);
  }
};

}  // namespace tdist::rpc::detail
