#pragma once
// tdist-train's one test hook: the fault injection that the launcher's and the trainer's tests
// drive through the environment (docs/train.md, "Testing hooks"). Nothing of it is a training
// option; the trainer only calls after_step() once per step.
//
//   TDIST_TRAIN_FAIL_AT_STEP=K   rank TDIST_TRAIN_FAIL_RANK (default: the last rank) kills
//                                itself with SIGKILL once K steps are done, on the first attempt
//                                only (TDIST_RESTART_COUNT unset or 0): restarts and resume
//   TDIST_TRAIN_STEP_SLEEP_MS=T  every step takes T ms longer, so that a test can act on a job
//                                while it trains
//
// Thread safety: read once, on the trainer's thread, then constant.

#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <thread>

#include "tdist/core/env.h"

namespace tdist::train {

class TestHook {
 public:
  // Off unless the variables above are set. InvalidArgument naming a variable out of range.
  static TestHook from_env(int rank, int world) {
    TestHook h;
    h.fail_at_step_ = env::get_int("TDIST_TRAIN_FAIL_AT_STEP", -1, -1, INT64_MAX);
    const int64_t fail_rank = env::get_int("TDIST_TRAIN_FAIL_RANK", world - 1, 0, world - 1);
    h.armed_ = h.fail_at_step_ >= 0 && fail_rank == rank &&
               env::get_int("TDIST_RESTART_COUNT", 0, 0, INT64_MAX) == 0;
    h.step_sleep_ms_ = env::get_int("TDIST_TRAIN_STEP_SLEEP_MS", 0, 0, 60000);
    return h;
  }

  // After each step, with the steps done so far: sleeps, or kills this process.
  void after_step(int64_t steps_done) const {
    if (step_sleep_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(step_sleep_ms_));
    if (!armed_ || steps_done != fail_at_step_) return;
    std::fprintf(stderr, "tdist-train: TDIST_TRAIN_FAIL_AT_STEP=%lld: killing this worker\n",
                 static_cast<long long>(fail_at_step_));
    std::fflush(stderr);
    ::raise(SIGKILL);
  }

 private:
  int64_t fail_at_step_ = -1;
  bool armed_ = false;
  int64_t step_sleep_ms_ = 0;
};

}  // namespace tdist::train
