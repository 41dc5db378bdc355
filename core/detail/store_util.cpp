#include "tdist/core/detail/store_util.h"

#include <charconv>
#include <cstdio>

#include "tdist/core/error.h"

namespace tdist::detail {

std::string join_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i) out += ", ";
    out += "'" + keys[i] + "'";
  }
  return out;
}

std::string seconds_text(Millis timeout) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.3g", timeout.count() / 1000.0);
  return buf;
}

int64_t parse_counter(const std::string& key, const Bytes& value) {
  int64_t out = 0;
  const char* begin = reinterpret_cast<const char*>(value.data());
  const char* end = begin + value.size();
  auto [ptr, ec] = std::from_chars(begin, end, out);
  if (value.empty() || ec != std::errc() || ptr != end) {
    TDIST_THROW(InvalidArgument, "store key '", key,
                "' holds a value that is not an integer; add() cannot be used on it");
  }
  return out;
}

void throw_wait_timeout(const std::string& store, const std::vector<std::string>& missing,
                        Millis timeout) {
  throw TimeoutError(str(store, ": timed out after ", seconds_text(timeout), " s waiting for key",
                         missing.size() == 1 ? " " : "s ", join_keys(missing)));
}

std::chrono::steady_clock::time_point deadline_after(Millis timeout) {
  if (effective_timeout(timeout) == Store::kNoTimeout)
    return std::chrono::steady_clock::time_point::max();
  return std::chrono::steady_clock::now() + timeout;
}

}  // namespace tdist::detail
