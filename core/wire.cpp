#include "tdist/core/wire.h"

#include "tdist/core/error.h"

namespace tdist::wire {

const uint8_t* Reader::raw(size_t size, const char* what) {
  if (size > remaining()) {
    throw ProtocolError(str("truncated input: ", what, " needs ", size, " bytes but only ",
                            remaining(), " remain"));
  }
  const uint8_t* p = data_ + pos_;
  pos_ += size;
  return p;
}

uint64_t Reader::length(const char* what, uint64_t max) {
  uint64_t n = u64(what);
  if (n > remaining() || n > max) {
    throw ProtocolError(str("bad length for ", what, ": ", n, " bytes (", remaining(),
                            " remain, limit ", max, ")"));
  }
  return n;
}

Bytes Reader::blob(const char* what, uint64_t max) {
  uint64_t n = length(what, max);
  const uint8_t* p = raw(n, what);
  return Bytes(p, p + n);
}

std::string Reader::string(const char* what, uint64_t max) {
  uint64_t n = length(what, max);
  return std::string(reinterpret_cast<const char*>(raw(n, what)), n);
}

void Reader::expect_end(const char* what) const {
  if (remaining() != 0) {
    throw ProtocolError(str(what, " has ", remaining(), " unexpected trailing bytes"));
  }
}

}  // namespace tdist::wire
