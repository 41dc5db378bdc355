#pragma once
// The testing hook of Note [Overlapped staging] for the staging tests: CPU tensors staged like
// CUDA ones, through a copy thread that delivers each piece late.

#include <chrono>
#include <string>

#include "tdist/comm/ring/staging.h"
#include "tests/harness/env_guard.h"

namespace tdist::comm {

// CPU tensors staged in pieces of `piece_bytes` (the groups created meanwhile read it), each
// piece copied `delay_us` late; `strided`: strided ones through contiguous stand-ins;
// `device_like`: copies late and unordered, up to `delay_us` each (StagingForTests).
class CpuStaging {
 public:
  CpuStaging(size_t piece_bytes, int delay_us, bool strided = false, bool device_like = false)
      : env_(tdist::test::EnvVars{{"TDIST_STAGING_PIECE_BYTES", std::to_string(piece_bytes)}}) {
    detail::StagingForTests s;
    s.cpu = true;
    s.strided = strided;
    s.device_like = device_like;
    s.delay = std::chrono::microseconds(delay_us);
    detail::set_staging_for_tests(s);
  }
  ~CpuStaging() { detail::set_staging_for_tests(detail::StagingForTests{}); }

 private:
  tdist::test::EnvGuard env_;
};

}  // namespace tdist::comm
