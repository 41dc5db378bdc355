#include "tdist/core/net/frame.h"

#include <cstring>

#include "tdist/core/error.h"

namespace tdist::net {

// The wire is little-endian and so is every host tdist builds for (core/wire.h).
void encode_frame_prefix(const FrameProtocol& protocol, uint16_t code, uint8_t* out) {
  std::memcpy(out, &protocol.magic, 4);
  std::memcpy(out + 4, &protocol.version, 2);
  std::memcpy(out + 6, &code, 2);
}

FramePrefix decode_frame_prefix(const uint8_t* in) {
  FramePrefix p;
  std::memcpy(&p.magic, in, 4);
  std::memcpy(&p.version, in + 4, 2);
  std::memcpy(&p.code, in + 6, 2);
  return p;
}

std::string frame_problem(const FramePrefix& prefix, const FrameProtocol& protocol) {
  if (prefix.magic != protocol.magic) {
    return str("bad magic 0x", std::hex, prefix.magic, " (expected 0x", protocol.magic,
               ": the peer does not speak ", protocol.name, ")");
  }
  if (prefix.version != protocol.version) {
    return str("unsupported protocol version ", prefix.version, " (", protocol.name,
               " here speaks ", protocol.version, ")");
  }
  return {};
}

FramePrefix check_frame_prefix(const uint8_t* in, const FrameProtocol& protocol) {
  const FramePrefix p = decode_frame_prefix(in);
  std::string problem = frame_problem(p, protocol);
  if (!problem.empty()) throw ProtocolError(problem);
  return p;
}

std::string length_problem(uint64_t length, uint64_t max, const char* what) {
  if (length <= max) return {};
  return str(what, " of ", length, " bytes exceeds the limit of ", max, " bytes");
}

}  // namespace tdist::net
