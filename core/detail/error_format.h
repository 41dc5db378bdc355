#pragma once
// What tdist::str and the TDIST_THROW / TDIST_CHECK macros of core/error.h expand to. Not an API.

#include <sstream>

namespace tdist::detail {

inline void stream_all(std::ostringstream&) {}

template <typename T, typename... Rest>
void stream_all(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  stream_all(os, rest...);
}

// Throws E with the arguments streamed, then " (file:line)".
template <typename E, typename... Args>
[[noreturn]] void throw_at(const char* file, int line, const Args&... args) {
  std::ostringstream os;
  stream_all(os, args..., " (", file, ":", line, ")");
  throw E(os.str());
}

}  // namespace tdist::detail
