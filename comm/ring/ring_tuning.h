#pragma once
// The ring backend's tunables, resolved: ProcessGroup::Options::RingTuning's fields where set,
// else their environment variables, else the defaults. resolve_ring_tuning is the only place
// the ring backend reads the environment (docs/configuration.md has the table).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "tdist/comm/process_group.h"

namespace tdist::comm::detail {

// Bytes per piece of a staged copy (Note [Overlapped staging]).
inline constexpr size_t kDefaultStagingPieceBytes = size_t{1} << 20;

// TDIST_ALLREDUCE_ALGO / ring.allreduce_algo, parsed once (the choice is made per operation).
enum class AllreduceChoice {
  kAuto,
  kRing,
  kRecursiveDoubling,
  kHalvingDoubling,
  kHierarchical,
  kSingleCopy
};

// TDIST_ALLGATHER_ALGO / ring.allgather_algo (Note [Which allgather] in
// ring_process_group.cpp). In this order because the group takes the largest of its ranks'
// choices: the ring wherever one rank asks for it.
enum class AllgatherChoice : uint64_t { kSingleCopy, kAuto, kRing };

struct RingTuningValues {
  size_t chunk_bytes = 256 * 1024;
  size_t small_allreduce_bytes = 64 * 1024;
  AllreduceChoice allreduce_algo = AllreduceChoice::kAuto;
  AllgatherChoice allgather_algo = AllgatherChoice::kAuto;
  size_t window_bytes = size_t{64} << 20;
  size_t staging_piece_bytes = kDefaultStagingPieceBytes;
  bool debug_detail = false;
  bool run_on_waiter = true;
  bool shared_memory = true;
  size_t shm_bytes = size_t{2} << 20;
  // Unset: chosen from the group's channels and hosts once they are known (Note [Spin, then
  // sleep] in ring_process_group.cpp).
  std::optional<int> spin_us;
  std::optional<int> busy_poll_ns;
  bool shm_futex = true;
  bool single_copy = true;
  uint64_t single_copy_bytes = 256 << 10;
};

// Throws InvalidArgument naming the field or the variable when a value is out of range.
RingTuningValues resolve_ring_tuning(const ProcessGroup::Options::RingTuning& set);

}  // namespace tdist::comm::detail
