#pragma once
// Futex sleep and wake on a 32-bit word that may live in memory shared between processes (no
// FUTEX_PRIVATE_FLAG). Used by the collectives' shared-memory rings (comm/transport/shm) and
// RPC's shared-memory frame streams (rpc/detail/shm_stream.h).

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

namespace tdist::futex {

inline uint32_t* word(std::atomic<uint32_t>& a) { return reinterpret_cast<uint32_t*>(&a); }

// Wakes one sleeper on `bell`.
inline void wake(std::atomic<uint32_t>& bell) {
  ::syscall(SYS_futex, word(bell), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

// Sleeps while `bell` still reads `seen`, at most `ns` nanoseconds. Any return may be spurious:
// the caller re-checks what it waits for.
inline void wait(std::atomic<uint32_t>& bell, uint32_t seen, int64_t ns) {
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  ::syscall(SYS_futex, word(bell), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

}  // namespace tdist::futex
