#include "tdist/comm/ring/ring_tuning.h"

#include <algorithm>
#include <initializer_list>
#include <utility>

#include "tdist/comm/transport/shm/shm_channel.h"
#include "tdist/core/env.h"
#include "tdist/core/error.h"

namespace tdist::comm::detail {
namespace {

// The field when set (checked against [min, max]), else the variable, else the default.
size_t bytes(const std::optional<size_t>& field, const char* field_name, const char* var,
             size_t fallback, int64_t min, int64_t max) {
  if (field) {
    TDIST_CHECK_ARG(*field >= static_cast<uint64_t>(min) && *field <= static_cast<uint64_t>(max),
                    "ProcessGroup::Options::ring.", field_name, " = ", *field, " is out of range [",
                    min, ", ", max, "]");
    return *field;
  }
  return static_cast<size_t>(env::get_int(var, static_cast<int64_t>(fallback), min, max));
}

std::optional<int> count(const std::optional<int>& field, const char* field_name, const char* var,
                         int max) {
  if (field) {
    TDIST_CHECK_ARG(*field >= 0 && *field <= max, "ProcessGroup::Options::ring.", field_name, " = ",
                    *field, " is out of range [0, ", max, "]");
    return field;
  }
  if (!env::get(var)) return std::nullopt;
  return static_cast<int>(env::get_int(var, 0, 0, max));
}

// "a, b, c": the names of a choice, for its error.
template <typename Choice>
std::string joined(std::initializer_list<std::pair<const char*, Choice>> names) {
  std::string out;
  for (const auto& n : names) out += std::string(out.empty() ? "" : ", ") + n.first;
  return out;
}

// The field when set, else the variable, else "auto", looked up among `names`; an unknown name
// is an error that names where it came from and lists the names.
template <typename Choice>
Choice choice(const std::optional<std::string>& field, const char* field_name, const char* var,
              std::initializer_list<std::pair<const char*, Choice>> names) {
  const std::string name = field ? *field : env::get(var).value_or("auto");
  const auto* found =
      std::find_if(names.begin(), names.end(), [&](const auto& n) { return name == n.first; });
  TDIST_CHECK_ARG(found != names.end(),
                  field ? str("ProcessGroup::Options::ring.", field_name) : std::string(var), "='",
                  name, "' is not one of ", joined(names));
  return found->second;
}

bool flag(const std::optional<bool>& field, const char* var, bool fallback) {
  return field ? *field : env::get_bool(var, fallback);
}

}  // namespace

RingTuningValues resolve_ring_tuning(const ProcessGroup::Options::RingTuning& set) {
  RingTuningValues v;
  v.chunk_bytes = bytes(set.chunk_bytes, "chunk_bytes", "TDIST_CHUNK_BYTES", v.chunk_bytes, 1,
                        int64_t(1) << 30);
  v.small_allreduce_bytes =
      bytes(set.small_allreduce_bytes, "small_allreduce_bytes", "TDIST_SMALL_ALLREDUCE_BYTES",
            v.small_allreduce_bytes, 0, int64_t(1) << 40);
  v.staging_piece_bytes =
      bytes(set.staging_piece_bytes, "staging_piece_bytes", "TDIST_STAGING_PIECE_BYTES",
            v.staging_piece_bytes, 0, int64_t(1) << 30);
  v.window_bytes = bytes(set.window_bytes, "window_bytes", "TDIST_WINDOW_BYTES", v.window_bytes, 1,
                         int64_t(1) << 62);
  v.allreduce_algo =
      choice<AllreduceChoice>(set.allreduce_algo, "allreduce_algo", "TDIST_ALLREDUCE_ALGO",
                              {{"auto", AllreduceChoice::kAuto},
                               {"ring", AllreduceChoice::kRing},
                               {"recursive_doubling", AllreduceChoice::kRecursiveDoubling},
                               {"halving_doubling", AllreduceChoice::kHalvingDoubling},
                               {"hierarchical", AllreduceChoice::kHierarchical},
                               {"single_copy", AllreduceChoice::kSingleCopy}});
  v.allgather_algo =
      choice<AllgatherChoice>(set.allgather_algo, "allgather_algo", "TDIST_ALLGATHER_ALGO",
                              {{"auto", AllgatherChoice::kAuto},
                               {"ring", AllgatherChoice::kRing},
                               {"single_copy", AllgatherChoice::kSingleCopy}});
  if (set.debug_detail) {
    v.debug_detail = *set.debug_detail;
  } else {
    const auto debug = env::get("TDIST_DEBUG").value_or("OFF");
    v.debug_detail = debug == "DETAIL" || debug == "detail";
  }
  v.run_on_waiter = flag(set.run_on_waiter, "TDIST_RUN_ON_WAITER", v.run_on_waiter);
  // The field is a bool (auto: true); only the variable is a name.
  v.shared_memory = set.shared_memory
                        ? *set.shared_memory
                        : choice<bool>(std::nullopt, "shared_memory", "TDIST_TRANSPORT",
                                       {{"auto", true}, {"tcp", false}});
  v.shm_bytes =
      bytes(set.shm_bytes, "shm_bytes", "TDIST_SHM_BYTES", v.shm_bytes,
            static_cast<int64_t>(shm::kMinCapacity), static_cast<int64_t>(shm::kMaxCapacity));
  v.spin_us = count(set.spin_us, "spin_us", "TDIST_SPIN_US", 1000000);
  v.busy_poll_ns = count(set.busy_poll_ns, "busy_poll_ns", "TDIST_BUSY_POLL_NS", 1000000000);
  v.shm_futex = flag(set.shm_futex, "TDIST_SHM_FUTEX", v.shm_futex);
  v.single_copy = flag(set.single_copy, "TDIST_SINGLE_COPY", v.single_copy);
  v.single_copy_bytes = bytes(set.single_copy_bytes, "single_copy_bytes", "TDIST_SINGLE_COPY_BYTES",
                              v.single_copy_bytes, 1, int64_t(1) << 62);
  return v;
}

}  // namespace tdist::comm::detail
