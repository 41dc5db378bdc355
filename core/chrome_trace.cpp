#include "tdist/core/chrome_trace.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "tdist/core/atomic_file.h"
#include "tdist/core/error.h"

namespace tdist {

namespace {

std::string json_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out;
}

}  // namespace

void write_chrome_trace(const std::string& path, int pid, const std::string& process_name,
                        const std::vector<std::string>& track_names,
                        const std::vector<ChromeTraceEvent>& events,
                        const std::string& other_data) {
  std::ostringstream os;
  os << "{\"displayTimeUnit\": \"ms\", \"otherData\": {" << other_data
     << "},\n\"traceEvents\": [\n";
  os << "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " << pid
     << ", \"args\": {\"name\": \"" << json_escape(process_name) << "\"}}";
  for (size_t t = 0; t < track_names.size(); ++t) {
    os << ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " << pid << ", \"tid\": " << t
       << ", \"args\": {\"name\": \"" << json_escape(track_names[t]) << "\"}}";
  }
  for (const ChromeTraceEvent& e : events) {
    os << ",\n{\"name\": \"" << json_escape(e.name) << "\", \"ph\": \"X\", \"pid\": " << pid
       << ", \"tid\": " << e.track << ", \"ts\": " << e.begin_us
       << ", \"dur\": " << std::max<int64_t>(e.end_us - e.begin_us, 0);
    if (!e.args.empty()) os << ", \"args\": {" << e.args << "}";
    os << "}";
  }
  os << "\n]}\n";
  // Never through a link planted at the temporary file's predictable name; 0600.
  const std::string text = os.str();
  write_file_atomically(path, {text});
}

std::string trace_path_for_rank(const std::string& pattern, int rank) {
  const std::string r = std::to_string(rank);
  auto pos = pattern.find("{rank}");
  if (pos != std::string::npos) return pattern.substr(0, pos) + r + pattern.substr(pos + 6);
  auto slash = pattern.rfind('/');
  auto dot = pattern.rfind('.');
  if (dot != std::string::npos && (slash == std::string::npos || dot > slash + 1)) {
    return pattern.substr(0, dot) + ".rank" + r + pattern.substr(dot);
  }
  return pattern + ".rank" + r;
}

}  // namespace tdist
