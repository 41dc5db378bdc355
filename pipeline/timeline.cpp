#include "tdist/pipeline/timeline.h"

#include "tdist/core/chrome_trace.h"
#include "tdist/core/error.h"

namespace tdist::pipeline {

int64_t StepTimeline::compute_us() const {
  int64_t sum = 0;
  for (const auto& e : events) {
    if (e.compute) sum += e.end_us - e.begin_us;
  }
  return sum;
}

int64_t StepTimeline::compute_begin_us() const {
  for (const auto& e : events) {
    if (e.compute) return e.begin_us;
  }
  return begin_us;
}

int64_t StepTimeline::compute_end_us() const {
  for (auto it = events.rbegin(); it != events.rend(); ++it) {
    if (it->compute) return it->end_us;
  }
  return end_us;
}

double pipeline_bubble(int64_t compute_us_all_ranks, int num_ranks, int64_t compute_begin_us,
                       int64_t compute_end_us) {
  const int64_t makespan = compute_end_us - compute_begin_us;
  if (makespan <= 0 || num_ranks < 1) return 0.0;
  return 1.0 - static_cast<double>(compute_us_all_ranks) /
                   (static_cast<double>(num_ranks) * static_cast<double>(makespan));
}

double StepTimeline::idle_fraction() const {
  const int64_t span = end_us - begin_us;
  if (span <= 0) return 0.0;
  return 1.0 - static_cast<double>(compute_us()) / static_cast<double>(span);
}

void write_trace(const std::string& path, int rank, const std::vector<StepTimeline>& timelines) {
  std::vector<ChromeTraceEvent> events;
  std::string idle = "[";
  for (size_t s = 0; s < timelines.size(); ++s) {
    const StepTimeline& t = timelines[s];
    events.push_back(ChromeTraceEvent{str("step ", s), 2, t.begin_us, t.end_us,
                                      str("\"idle_fraction\": ", t.idle_fraction())});
    for (const auto& e : t.events) {
      events.push_back(ChromeTraceEvent{e.name, e.compute ? 0 : 1, e.begin_us, e.end_us, {}});
    }
    idle += str(s ? ", " : "", t.idle_fraction());
  }
  idle += "]";
  write_chrome_trace(path, rank, str("pipeline rank ", rank), {"compute", "wait", "step"}, events,
                     str("\"rank\": ", rank, ", \"idle_fraction\": ", idle));
}

}  // namespace tdist::pipeline
