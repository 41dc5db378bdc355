#pragma once
// StepTimeline: what one rank computed during one Pipeline::step, and when (microseconds of
// std::chrono::steady_clock, i.e. CLOCK_MONOTONIC on Linux, which every process of one host
// shares: the timelines of ranks on one host line up), so that the bubble can be measured and
// seen (Perfetto / chrome://tracing). Plain data; no libtorch.

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
  // Start of the first and end of the last compute event (begin_us / end_us when none).
  int64_t compute_begin_us() const;
  int64_t compute_end_us() const;
  // 1 - compute / (end - begin): the share of its own step() call this rank was not computing.
  // It counts what the pipeline's bubble does not: the rank's wait for its first input includes
  // its neighbours' work between steps (their optimizer step), and its last sends' wait.
  double idle_fraction() const;
};

// The pipeline's bubble as Note [Pipeline schedules] defines it for the simulated timetable:
// the idle share of p ranks over the step's makespan, 1 - (sum of every rank's compute) /
// (p * makespan), where the makespan runs from the first compute event on any rank (the first
// forward on stage 0) to the last one's end (the last backward on stage 0). Time between steps
// (set-up, zero_grad, the optimizer step) is outside it; the loss, on the last stage, is part of
// that stage's forward. `compute_us_all_ranks` sums compute_us() over the ranks of one step;
// begin/end are the least compute_begin_us() and the greatest compute_end_us() of that step
// (comparable between ranks of one host). 0 when the makespan is empty.
double pipeline_bubble(int64_t compute_us_all_ranks, int num_ranks, int64_t compute_begin_us,
                       int64_t compute_end_us);

// Writes `timelines` (one rank's steps, in order) as a Chrome-trace JSON file: one process
// (the rank), a "compute", a "wait" and a "step" track; the file is written whole (temporary
// file, then rename; core/chrome_trace.h, DDP's writer too). Throws Error when it cannot be
// written.
void write_trace(const std::string& path, int rank, const std::vector<StepTimeline>& timelines);

}  // namespace tdist::pipeline
