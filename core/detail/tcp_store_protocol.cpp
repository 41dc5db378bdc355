#include "tdist/core/detail/tcp_store_protocol.h"

#include <cstring>

#include "tdist/core/error.h"

namespace tdist::detail::tcp_store {

const char* command_name(uint16_t code) {
  switch (static_cast<Command>(code)) {
    case Command::kSet:
      return "set";
    case Command::kGet:
      return "get";
    case Command::kAdd:
      return "add";
    case Command::kCompareSet:
      return "compare_set";
    case Command::kWait:
      return "wait";
    case Command::kCheck:
      return "check";
    case Command::kDelete:
      return "delete_key";
    case Command::kNumKeys:
      return "num_keys";
  }
  return "unknown";
}

bool is_known_command(uint16_t code) {
  return code >= static_cast<uint16_t>(Command::kSet) &&
         code <= static_cast<uint16_t>(Command::kNumKeys);
}

void encode_header(const Header& h, uint8_t* out) {
  // The magic and version of `h`, not kProtocol's: tests write wrong ones on purpose.
  net::encode_frame_prefix({h.magic, h.version, kProtocol.name}, h.code, out);
  std::memcpy(out + net::kFramePrefixBytes, &h.body_bytes, 8);
}

Header decode_header(const uint8_t* in) {
  const net::FramePrefix p = net::decode_frame_prefix(in);
  Header h{p.magic, p.version, p.code, 0};
  std::memcpy(&h.body_bytes, in + net::kFramePrefixBytes, 8);
  return h;
}

std::string header_problem(const Header& h, uint64_t max_body) {
  std::string problem = net::frame_problem({h.magic, h.version, h.code}, kProtocol);
  if (problem.empty()) problem = net::length_problem(h.body_bytes, max_body, "frame body");
  return problem;
}

Bytes make_frame(uint16_t code, const Bytes& body) {
  Bytes frame(kHeaderBytes);
  Header h;
  h.code = code;
  h.body_bytes = body.size();
  encode_header(h, frame.data());
  frame.insert(frame.end(), body.begin(), body.end());
  return frame;
}

void write_keys(wire::Writer& w, const std::vector<std::string>& keys) {
  TDIST_CHECK_ARG(keys.size() <= kMaxKeys, "a store wait/check takes at most ", kMaxKeys,
                  " keys, not ", keys.size());
  w.u64(keys.size());
  for (const auto& k : keys) w.string(k);
}

std::vector<std::string> read_keys(wire::Reader& r) {
  const uint64_t n = r.u64("key count");
  if (n > kMaxKeys) throw ProtocolError(str("key count ", n, " exceeds the limit of ", kMaxKeys));
  if (n > r.remaining() / 8) {
    throw ProtocolError(
        str("key count ", n, " is larger than the ", r.remaining(), " remaining bytes allow"));
  }
  std::vector<std::string> keys;
  keys.reserve(n);
  for (uint64_t i = 0; i < n; ++i) keys.push_back(r.string("key"));
  return keys;
}

}  // namespace tdist::detail::tcp_store
