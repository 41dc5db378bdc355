#pragma once
// Pipeline schedules as per-rank action lists (see Note [Pipeline schedules] in pipeline.h).
//
// A schedule is generated once, on every rank alike, by make_schedule(): one ordered list of
// actions per rank. The runtime (Pipeline::step) executes its own rank's list in order; the
// lists are made by simulating the schedule's rule with unit costs, so that every action's
// inputs are produced earlier in simulated time, which makes in-order execution deadlock-free.
// No libtorch here: the lists are plain data that tests and the Note can print.

#include <cstdint>
#include <string>
#include <vector>

namespace tdist::pipeline {

enum class ScheduleKind {
  kGPipe,            // all forwards, then all backwards
  k1F1B,             // one forward, one backward; at most p - rank microbatches in flight
  kInterleaved1F1B,  // 1F1B over v chunks per rank (virtual stages), Megatron's order
  kZeroBubbleH1,     // 1F1B with backward split into input-gradient (I) and weight (W) passes
};

// "gpipe", "1f1b", "interleaved", "zb" (also "zbh1"); throws InvalidArgument listing them.
ScheduleKind parse_schedule(const std::string& name);
std::string to_string(ScheduleKind kind);

struct Action {
  enum class Type : uint8_t {
    kForward,         // F: forward of one microbatch through one chunk
    kBackward,        // B: full backward (input and weight gradients)
    kBackwardInput,   // I: the gradient of the chunk's input only (zero-bubble)
    kBackwardWeight,  // W: the weight gradients, later (zero-bubble)
  };
  Type type;
  int microbatch;
  int chunk;  // this rank's chunk; its virtual stage is chunk * num_ranks + rank
  bool operator==(const Action& o) const {
    return type == o.type && microbatch == o.microbatch && chunk == o.chunk;
  }
};

// "F3", "B0", "I1", "W2"; with chunks > 1 the chunk is appended: "F3.1".
std::string to_string(const Action& a, bool with_chunk = false);

struct Schedule {
  ScheduleKind kind;
  int num_ranks;                             // p
  int num_microbatches;                      // m
  int num_chunks;                            // v (1 unless interleaved)
  std::vector<std::vector<Action>> actions;  // per rank, in execution order
  // The simulation's timetable with unit costs (F = 1, B = 2, I = W = 1): per rank, one entry per
  // time unit: the action's index in actions[rank], or -1 when idle.
  std::vector<std::vector<int>> timetable;
  // Idle fraction of the simulated timetable (every rank's idle units over p * makespan).
  double simulated_bubble() const;
  // Most microbatches (per chunk) whose activations one rank holds at once (forwarded, weight
  // gradients not yet computed), per rank.
  std::vector<int> peak_in_flight() const;
  // The timetable as text, one line per rank (the Note's pictures).
  std::string format() const;
  // Per action of `rank`: the index of the action of `rank` before which its receive (the
  // activation of an F, the gradient of a B or I) is posted: the one that rank runs in the
  // simulated timetable when the peer starts the action that produces the message, and at the
  // latest `window` actions ahead (index - window). Actions that receive nothing get their own
  // index. Posting there lets the sender's message land in its buffer as soon as it is sent,
  // while keeping the posted buffers within what the timetable holds in flight.
  std::vector<size_t> receive_post_index(int rank, int window) const;
};

// Throws InvalidArgument for p < 1, m < 1, v < 1, v > 1 for a schedule other than interleaved,
// or interleaved with v < 2.
Schedule make_schedule(ScheduleKind kind, int num_ranks, int num_microbatches, int num_chunks = 1);

// The analytic bubble (p - 1) / (m + p - 1) of GPipe and 1F1B with equal stages.
double analytic_bubble(int num_ranks, int num_microbatches);

}  // namespace tdist::pipeline
