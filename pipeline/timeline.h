#pragma once
// StepTimeline: what one rank computed during one Pipeline::step, and when (microseconds on a
// steady clock), so that the bubble can be measured and seen (Perfetto / chrome://tracing).
// Plain data; no libtorch.

#include <cstdint>
#include <string>
#include <vector>

namespace tdist::pipeline {

struct TimelineEvent {
  std::string name;  // "F3", "B0", "I1.0", "W2", or "wait F3" for the time an action waited
  int64_t begin_us = 0;
  int64_t end_us = 0;
  bool compute = true;  // false: waiting for a peer (an activation, a gradient, a send)
};

struct StepTimeline {
  int rank = 0;
  int64_t begin_us = 0;  // step() entered
  int64_t end_us = 0;    // step() returned
  std::vector<TimelineEvent> events;

  int64_t compute_us() const;
  // 1 - compute / (end - begin): the share of the step this rank was not computing.
  double idle_fraction() const;
};

// Writes `timelines` (one rank's steps, in order) as a Chrome-trace JSON file: one process
// (the rank), a "compute", a "wait" and a "step" track; the file is written whole (temporary
// file, then rename; core/chrome_trace.h, DDP's writer too). Throws Error when it cannot be
// written.
void write_trace(const std::string& path, int rank, const std::vector<StepTimeline>& timelines);

}  // namespace tdist::pipeline
