#pragma once
// Frame layout and command codes of the TCPStore protocol, shared by the server and the client.
// See Note [TCPStore protocol] in core/tcp_store.cpp.

#include <cstdint>
#include <string>
#include <vector>

#include "tdist/core/net/frame.h"
#include "tdist/core/store.h"
#include "tdist/core/wire.h"

namespace tdist::detail::tcp_store {

constexpr uint32_t kMagic = 0x54534454;  // the bytes "TDST" read as a little-endian u32
constexpr uint16_t kVersion = 1;
constexpr net::FrameProtocol kProtocol{kMagic, kVersion, "the TCPStore protocol"};
// The frame prefix (Note [Frame prefix] in core/net/frame.h), then the u64 body length.
constexpr size_t kHeaderBytes = net::kFramePrefixBytes + 8;

// Requests (the u16 code of a request frame).
enum class Command : uint16_t {
  kSet = 1,         // string key, blob value                      -> (empty)
  kGet = 2,         // string key, i64 timeout ms (0: forever)     -> blob value | kTimeout
  kAdd = 3,         // string key, i64 delta                       -> i64 new value | kInvalid
  kCompareSet = 4,  // string key, blob expected, blob desired     -> blob value
  kWait = 5,        // u64 n, n x string key, i64 timeout ms       -> (empty) | kTimeout
  kCheck = 6,       // u64 n, n x string key                       -> u8 all present
  kDelete = 7,      // string key                                  -> u8 existed
  kNumKeys = 8,     // (empty)                                     -> i64 count
};

// Replies (the u16 code of a reply frame).
enum class Status : uint16_t {
  kOk = 0,
  kTimeout = 1,  // body: u64 n, n x string missing key
  kInvalid = 2,  // body: string message (the request was well formed but cannot be done)
};

// Keys the TCPStore keeps for itself (the num_workers join); num_keys() does not count them.
constexpr const char* kInternalKeyPrefix = "__tdist_tcpstore/";

const char* command_name(uint16_t code);
bool is_known_command(uint16_t code);

struct Header {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t code = 0;
  uint64_t body_bytes = 0;
};

// Writes the 16 header bytes.
void encode_header(const Header& h, uint8_t* out);
Header decode_header(const uint8_t* in);

// Why a header cannot be accepted (empty when it can): wrong magic, wrong version, or a body
// longer than `max_body`.
std::string header_problem(const Header& h, uint64_t max_body);

// A whole frame: header followed by `body`.
Bytes make_frame(uint16_t code, const Bytes& body);

// A list of keys as u64 count + strings. The count is checked against the bytes that remain
// (each key takes at least 8) before anything is reserved.
// A key list (wait, check, a timeout's missing keys) holds at most kMaxKeys keys: decoded keys
// cost several times their wire size, so the count is bounded, not only the frame's bytes.
constexpr uint64_t kMaxKeys = uint64_t(1) << 16;
// Throws InvalidArgument when `keys` holds more than kMaxKeys.
void write_keys(wire::Writer& w, const std::vector<std::string>& keys);
// Throws ProtocolError when the count exceeds kMaxKeys or the remaining bytes.
std::vector<std::string> read_keys(wire::Reader& r);

}  // namespace tdist::detail::tcp_store
