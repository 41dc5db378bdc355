// Compiled without libtorch's include directories (see core/CMakeLists.txt): libtorch ships its
// own {fmt}, which must not meet the one Debian's spdlog was built against.
#include "tdist/core/logging.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <mutex>

namespace tdist {
namespace {

spdlog::level::level_enum to_spd(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace:
      return spdlog::level::trace;
    case LogLevel::kDebug:
      return spdlog::level::debug;
    case LogLevel::kInfo:
      return spdlog::level::info;
    case LogLevel::kWarn:
      return spdlog::level::warn;
    case LogLevel::kError:
      return spdlog::level::err;
    case LogLevel::kOff:
      return spdlog::level::off;
  }
  return spdlog::level::warn;
}

struct Logger {
  std::shared_ptr<spdlog::logger> impl;
  std::atomic<int> level{static_cast<int>(LogLevel::kWarn)};
  std::mutex mu;  // guards the pattern (rank) changes

  Logger() {
    impl = std::make_shared<spdlog::logger>("tdist",
                                            std::make_shared<spdlog::sinks::stderr_sink_mt>());
    impl->set_level(spdlog::level::trace);  // we filter ourselves
    const char* rank = std::getenv("RANK");
    set_rank(rank ? std::atoi(rank) : -1);
    if (const char* env = std::getenv("TDIST_LOG_LEVEL")) {
      try {
        level = static_cast<int>(parse_log_level(env));
      } catch (const std::exception& e) {
        impl->warn("{}; using warn", e.what());
      }
    }
  }

  void set_rank(int rank) {
    std::lock_guard<std::mutex> lock(mu);
    std::string r = rank >= 0 ? std::to_string(rank) : std::string("?");
    impl->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [rank " + r + "] [%l] %v");
  }
};

Logger& logger() {
  static Logger* instance = new Logger();  // never destroyed: usable from static destructors
  return *instance;
}

}  // namespace

LogLevel parse_log_level(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  if (n == "trace") return LogLevel::kTrace;
  if (n == "debug") return LogLevel::kDebug;
  if (n == "info") return LogLevel::kInfo;
  if (n == "warn" || n == "warning") return LogLevel::kWarn;
  if (n == "error") return LogLevel::kError;
  if (n == "off") return LogLevel::kOff;
  throw InvalidArgument("TDIST_LOG_LEVEL='" + name +
                        "' is not one of trace, debug, info, warn, error, off");
}

LogLevel log_level() { return static_cast<LogLevel>(logger().level.load()); }

void set_log_level(LogLevel level) { logger().level = static_cast<int>(level); }

void set_log_rank(int rank) { logger().set_rank(rank); }

bool log_enabled(LogLevel level) {
  return level != LogLevel::kOff && static_cast<int>(level) >= logger().level.load();
}

void log_line(LogLevel level, const std::string& message) {
  logger().impl->log(to_spd(level), "{}", message);
}

}  // namespace tdist
