#include "tdist/ddp/trace.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"

namespace tdist::ddp {

namespace {

std::string json_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
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

std::shared_ptr<Trace> Trace::from_env(int rank) {
  auto pattern = env::get("TDIST_TRACE");
  if (!pattern || pattern->empty()) return nullptr;
  return std::make_shared<Trace>(path_for_rank(*pattern, rank), rank);
}

std::string Trace::path_for_rank(const std::string& pattern, int rank) {
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

Trace::Trace(std::string path, int rank) : path_(std::move(path)), rank_(rank) {}

Trace::~Trace() {
  try {
    flush();
  } catch (const std::exception& e) {
    TDIST_LOG_WARN("DDP trace: ", e.what());
  }
}

int64_t Trace::now_us() {
  static const auto start = std::chrono::steady_clock::now();
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                               start)
      .count();
}

void Trace::add(std::string name, Track track, int64_t begin_us, int64_t end_us, std::string args) {
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.size() >= kMaxEvents) {
    ++dropped_;
    return;
  }
  events_.push_back(Event{std::move(name), track, begin_us, end_us, std::move(args)});
}

void Trace::flush() {
  std::ostringstream os;
  {
    std::lock_guard<std::mutex> lock(mu_);
    os << "{\"displayTimeUnit\": \"ms\", \"otherData\": {\"rank\": " << rank_
       << ", \"dropped_events\": " << dropped_ << "},\n\"traceEvents\": [\n";
    os << "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " << rank_
       << ", \"args\": {\"name\": \"rank " << rank_ << "\"}},\n";
    os << "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " << rank_
       << ", \"tid\": 0, \"args\": {\"name\": \"compute\"}},\n";
    os << "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " << rank_
       << ", \"tid\": 1, \"args\": {\"name\": \"comm\"}}";
    for (const Event& e : events_) {
      os << ",\n{\"name\": \"" << json_escape(e.name) << "\", \"ph\": \"X\", \"pid\": " << rank_
         << ", \"tid\": " << static_cast<int>(e.track) << ", \"ts\": " << e.begin_us
         << ", \"dur\": " << std::max<int64_t>(e.end_us - e.begin_us, 0);
      if (!e.args.empty()) os << ", \"args\": {" << e.args << "}";
      os << "}";
    }
    os << "\n]}\n";
  }
  const std::string tmp = path_ + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    TDIST_CHECK(f.good(), "cannot open trace file ", tmp, " for writing");
    f << os.str();
    f.flush();
    TDIST_CHECK(f.good(), "cannot write trace file ", tmp);
  }
  TDIST_CHECK(std::rename(tmp.c_str(), path_.c_str()) == 0, "cannot rename ", tmp, " to ", path_);
}

}  // namespace tdist::ddp
