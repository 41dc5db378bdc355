// Fuzzes the TCPStore protocol's decoders (core/detail/tcp_store_protocol.h, core/wire.h) as the
// server and the client use them: a header, then a body read as the command in the header says.
// Any input must give a decoded value or a ProtocolError, never a crash, a sanitizer report or
// an allocation the bytes do not pay for.
#include <cstddef>
#include <cstdint>

#include "tdist/core/detail/tcp_store_protocol.h"
#include "tdist/core/error.h"
#include "tdist/core/wire.h"

namespace proto = tdist::detail::tcp_store;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < proto::kHeaderBytes) return 0;
  const proto::Header h = proto::decode_header(data);
  const std::string problem = proto::header_problem(h, uint64_t(1) << 30);
  (void)proto::command_name(h.code);
  tdist::wire::Reader r(data + proto::kHeaderBytes, size - proto::kHeaderBytes);
  try {
    switch (static_cast<proto::Command>(h.code)) {
      case proto::Command::kSet:
        r.string("key");
        r.blob("value");
        break;
      case proto::Command::kGet:
        r.string("key");
        r.i64("timeout");
        break;
      case proto::Command::kAdd:
        r.string("key");
        r.i64("delta");
        break;
      case proto::Command::kCompareSet:
        r.string("key");
        r.blob("expected");
        r.blob("desired");
        break;
      case proto::Command::kWait:
        proto::read_keys(r);
        r.i64("timeout");
        break;
      case proto::Command::kCheck:
        proto::read_keys(r);
        break;
      case proto::Command::kDelete:
        r.string("key");
        break;
      default:
        // Replies: a timeout's missing keys, an error message, a value.
        if (h.code % 3 == 0)
          proto::read_keys(r);
        else if (h.code % 3 == 1)
          r.string("message");
        else
          r.blob("value");
    }
    r.expect_end("fuzzed body");
  } catch (const tdist::ProtocolError&) {}
  return 0;
}
