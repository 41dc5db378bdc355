#pragma once
// Logging: every line carries the time, the rank and the level; the level comes from
// TDIST_LOG_LEVEL (trace, debug, info, warn, error, off; default warn) and the rank from
// set_log_rank() or, until it is called, the RANK environment variable.
//
//   TDIST_LOG_INFO("connected to ", peer, " in ", ms, " ms");
//
// Arguments are streamed with operator<< and only evaluated when the level is enabled.
// Thread safe. Lines go to stderr.

#include <string>

#include "tdist/core/error.h"

namespace tdist {

enum class LogLevel { kTrace = 0, kDebug, kInfo, kWarn, kError, kOff };

// Parses a level name (case-insensitive; "warning" is accepted); throws InvalidArgument.
LogLevel parse_log_level(const std::string& name);

LogLevel log_level();
void set_log_level(LogLevel level);
void set_log_rank(int rank);  // -1: unknown
bool log_enabled(LogLevel level);
void log_line(LogLevel level, const std::string& message);

}  // namespace tdist

#define TDIST_LOG(level, ...)                              \
  do {                                                     \
    if (::tdist::log_enabled(level)) {                     \
      ::tdist::log_line(level, ::tdist::str(__VA_ARGS__)); \
    }                                                      \
  } while (0)
#define TDIST_LOG_TRACE(...) TDIST_LOG(::tdist::LogLevel::kTrace, __VA_ARGS__)
#define TDIST_LOG_DEBUG(...) TDIST_LOG(::tdist::LogLevel::kDebug, __VA_ARGS__)
#define TDIST_LOG_INFO(...) TDIST_LOG(::tdist::LogLevel::kInfo, __VA_ARGS__)
#define TDIST_LOG_WARN(...) TDIST_LOG(::tdist::LogLevel::kWarn, __VA_ARGS__)
#define TDIST_LOG_ERROR(...) TDIST_LOG(::tdist::LogLevel::kError, __VA_ARGS__)
