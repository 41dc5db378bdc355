#include "tdist/ddp/trace.h"

#include <chrono>

#include "tdist/core/chrome_trace.h"
#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"

namespace tdist::ddp {

std::shared_ptr<Trace> Trace::from_env(int rank) {
  auto pattern = env::get("TDIST_TRACE");
  if (!pattern || pattern->empty()) return nullptr;
  return std::make_shared<Trace>(path_for_rank(*pattern, rank), rank);
}

std::string Trace::path_for_rank(const std::string& pattern, int rank) {
  return trace_path_for_rank(pattern, rank);
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
  std::vector<ChromeTraceEvent> events;
  std::string other;
  {
    std::lock_guard<std::mutex> lock(mu_);
    events.reserve(events_.size());
    for (const Event& e : events_) {
      events.push_back(
          ChromeTraceEvent{e.name, static_cast<int>(e.track), e.begin_us, e.end_us, e.args});
    }
    other = str("\"rank\": ", rank_, ", \"dropped_events\": ", dropped_);
  }
  write_chrome_trace(path_, rank_, str("rank ", rank_), {"compute", "comm"}, events, other);
}

}  // namespace tdist::ddp
