#pragma once
// The prefix every framed message of tdist starts with.
//
// Note [Frame prefix]
// ~~~~~~~~~~~~~~~~~~~
// A TCPStore request or reply, an RPC frame and the handshake's first two messages all begin with
// the same 8 bytes, little-endian:
//
//   u32 magic | u16 version | u16 code
//
// The magic names the protocol, so a peer that speaks another one (or another service's port) is
// told apart from a corrupt frame; the version is the protocol's own; the code is what the
// message is (a store command or status, an RPC message type, the handshake's service). What
// follows is each protocol's own: the store's u64 body length (core/detail/tcp_store_protocol.h),
// RPC's flags, lengths and id (Note [RPC wire format] in rpc/detail/message.h), the handshake's nonce
// (Note [Connection handshake] in core/net/handshake.h). The collective mesh frames nothing after
// its handshake: both ends of a step know its sizes (Note [Mesh handshake] in
// comm/transport/tcp/mesh.h).
//
// A receiver checks the prefix before anything else, and every length a peer announces against
// its limit before it allocates: frame_problem() and length_problem() say what is wrong in the
// same words for every protocol.

#include <cstddef>
#include <cstdint>
#include <string>

namespace tdist::net {

// One framed protocol: its magic, its version and its name in messages.
struct FrameProtocol {
  uint32_t magic;
  uint16_t version;
  const char* name;
};

struct FramePrefix {
  uint32_t magic = 0;
  uint16_t version = 0;
  uint16_t code = 0;
};

constexpr size_t kFramePrefixBytes = 8;

// Writes protocol's magic and version and `code` at out[0, 8).
void encode_frame_prefix(const FrameProtocol& protocol, uint16_t code, uint8_t* out);
FramePrefix decode_frame_prefix(const uint8_t* in);

// What is wrong with `prefix` for `protocol` (empty when nothing): "bad magic 0x... (expected
// 0x...: the peer does not speak <name>)" or "unsupported protocol version V (<name> here
// speaks W)".
std::string frame_problem(const FramePrefix& prefix, const FrameProtocol& protocol);

// Decodes the prefix at `in` and returns it; ProtocolError with frame_problem() when it is not
// `protocol`'s.
FramePrefix check_frame_prefix(const uint8_t* in, const FrameProtocol& protocol);

// "<what> of N bytes exceeds the limit of M bytes" when length > max, else empty.
std::string length_problem(uint64_t length, uint64_t max, const char* what);

}  // namespace tdist::net
