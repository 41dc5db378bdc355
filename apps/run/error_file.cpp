#include "apps/run/error_file.h"

#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace tdist::run {

// Note [Worker error files]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// torchrun gives every worker TORCHELASTIC_ERROR_FILE, a path of its own per attempt that does
// not exist yet. torch.distributed.elastic's `@record` (its ErrorHandler) writes the uncaught
// exception there as JSON:
//   {"message": {"message": "ValueError: boom",
//                "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1764270000"}}}
// and a nested launcher may copy a child's file, with "errorCode" added, or write "message" as a
// plain string with "timestamp" beside it. A C++ worker may write the same shape. tdist-run sets
// the variable the same way (under --log-dir, or a directory of its own removed at exit), and
// when workers fail it prints torchrun's ChildFailedError report: each failure's time, host,
// rank, exit code (minus the signal number when killed), error file and traceback, the one
// with the earliest timestamp as the root cause. A worker that wrote no file is reported as
// torchrun does ("<N/A>", or the signal that killed it). The file is read bounded
// (kMaxErrorFileBytes) and a malformed one is named as such in the report.

namespace {

constexpr size_t kMaxErrorFileBytes = 1 << 20;
constexpr const char* kNotAvailable = "<N/A>";

std::string signal_text(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : kNotAvailable;
}

// Python's socket.getfqdn(): the canonical name of this host, or its plain name.
std::string fqdn() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) return "localhost";
  addrinfo hints{};
  hints.ai_flags = AI_CANONNAME;
  addrinfo* res = nullptr;
  std::string name = host;
  if (::getaddrinfo(host, nullptr, &hints, &res) == 0) {
    if (res != nullptr && res->ai_canonname != nullptr) name = res->ai_canonname;
    ::freeaddrinfo(res);
  }
  return name;
}

// "YYYY-MM-DD_HH:MM:SS" in local time (datetime.fromtimestamp(t).isoformat(sep="_")).
std::string iso_time(int64_t t) {
  std::time_t tt = static_cast<std::time_t>(t);
  std::tm tm{};
  ::localtime_r(&tt, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d_%H:%M:%S", &tm);
  return buf;
}

int64_t number_of(const nlohmann::json& j) {
  if (j.is_number_integer()) return j.get<int64_t>();
  if (j.is_number()) return static_cast<int64_t>(j.get<double>());
  if (j.is_string()) return std::stoll(j.get<std::string>());
  throw std::invalid_argument("timestamp is neither a number nor a string");
}

// Fills message and timestamp from the file's JSON (torchrun's _get_error_data and
// _format_failure); throws on a shape that is not torchrun's.
void parse_error_data(const nlohmann::json& data, ProcessFailure& f) {
  const auto& message = data.at("message");
  if (message.is_string()) {
    f.message = message.get<std::string>();
    f.timestamp = data.contains("timestamp") ? number_of(data["timestamp"]) : 0;
    return;
  }
  const auto& extra = message.at("extraInfo");
  f.timestamp = number_of(extra.at("timestamp"));
  if (extra.contains("py_callstack") && extra["py_callstack"].is_string()) {
    f.message = extra["py_callstack"].get<std::string>();
  } else if (message.contains("message") && message["message"].is_string()) {
    f.message = message["message"].get<std::string>();
  } else {
    f.message = kNotAvailable;
  }
}

}  // namespace

ProcessFailure read_process_failure(int rank, int local_rank, pid_t pid, int exitcode,
                                    const std::string& path) {
  ProcessFailure f;
  f.rank = rank;
  f.local_rank = local_rank;
  f.pid = pid;
  f.exitcode = exitcode;
  f.timestamp = static_cast<int64_t>(std::time(nullptr));
  std::ifstream in(path, std::ios::binary);
  if (!path.empty() && in) {
    f.error_file = path;
    std::string text(kMaxErrorFileBytes + 1, '\0');
    in.read(text.data(), static_cast<std::streamsize>(text.size()));
    text.resize(static_cast<size_t>(in.gcount()));
    try {
      if (text.size() > kMaxErrorFileBytes) {
        throw std::length_error("larger than " + std::to_string(kMaxErrorFileBytes) + " bytes");
      }
      parse_error_data(nlohmann::json::parse(text), f);
    } catch (const std::exception& e) {
      f.message =
          std::string("(the error file is not torch.distributed.elastic's JSON: ") + e.what() + ")";
    }
    if (!f.message.empty()) return f;
  } else {
    f.error_file = kNotAvailable;
  }
  if (exitcode < 0) {
    f.message = "Signal " + std::to_string(-exitcode) + " (" + signal_text(-exitcode) +
                ") received by PID " + std::to_string(pid);
  } else {
    f.message = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html";
  }
  return f;
}

std::string format_child_failed(const std::string& name,
                                const std::vector<ProcessFailure>& failures) {
  const std::string title = name + " FAILED";
  size_t root = 0;
  for (size_t i = 1; i < failures.size(); ++i) {
    if (failures[i].timestamp < failures[root].timestamp) root = i;
  }
  const std::string host = fqdn();
  size_t width = title.size();
  std::string root_text;
  std::vector<std::string> others;
  for (size_t i = 0; i < failures.size(); ++i) {
    const ProcessFailure& f = failures[i];
    std::string message;
    for (char c : f.message) message += c == '\n' ? std::string("\n  ") : std::string(1, c);
    std::ostringstream s;
    s << "[" << i << "]:\n"
      << "  time      : " << iso_time(f.timestamp) << "\n"
      << "  host      : " << host << "\n"
      << "  rank      : " << f.rank << " (local_rank: " << f.local_rank << ")\n"
      << "  exitcode  : " << f.exitcode << " (pid: " << f.pid << ")\n"
      << "  error_file: " << f.error_file << "\n"
      << "  traceback : " << message;
    const std::string text = s.str();
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) width = std::max(width, line.size());
    if (i == root) {
      root_text = text;
    } else {
      others.push_back(text);
    }
  }
  width = std::min<size_t>(width, 60);
  const std::string border(width, '='), section(width, '-');
  std::string out = "\n" + border + "\n" + title + "\n" + section + "\nFailures:\n";
  if (others.empty()) out += "  <NO_OTHER_FAILURES>\n";
  for (const auto& o : others) out += o + "\n";
  out += section + "\nRoot Cause (first observed failure):\n" + root_text + "\n" + border + "\n";
  return out;
}

}  // namespace tdist::run
