#include "tdist/core/env.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>

#include "tdist/core/error.h"

namespace tdist::env {

std::optional<std::string> get(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

std::string require(const std::string& name) {
  auto v = get(name);
  if (!v) throw InvalidArgument("environment variable " + name + " is not set");
  return *v;
}

int64_t parse_int(const std::string& name, const std::string& value, int64_t min, int64_t max) {
  int64_t out = 0;
  const char* begin = value.data();
  const char* end = begin + value.size();
  auto [ptr, ec] = std::from_chars(begin, end, out);
  if (value.empty() || ec != std::errc() || ptr != end || out < min || out > max) {
    throw InvalidArgument(str(name, "='", value, "' is not an integer in [", min, ", ", max, "]"));
  }
  return out;
}

int64_t get_int(const std::string& name, int64_t fallback, int64_t min, int64_t max) {
  auto v = get(name);
  return v ? parse_int(name, *v, min, max) : fallback;
}

int64_t require_int(const std::string& name, int64_t min, int64_t max) {
  return parse_int(name, require(name), min, max);
}

bool get_bool(const std::string& name, bool fallback) {
  auto v = get(name);
  if (!v) return fallback;
  std::string s = *v;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off") return false;
  throw InvalidArgument(str(name, "='", *v, "' is not a boolean (1/0, true/false, yes/no, on/off)"));
}

namespace {

constexpr int64_t kMaxRanks = 1 << 24;

struct Names {
  const char* source;
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size;
};

constexpr Names kTorchrun{"env", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
constexpr Names kSlurm{"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                       "SLURM_NTASKS_PER_NODE"};
constexpr Names kOpenMpi{"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                         "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"};

DistEnv read_with(const Names& n) {
  DistEnv e;
  e.source = n.source;
  e.world_size = static_cast<int>(require_int(n.size, 1, kMaxRanks));
  e.rank = static_cast<int>(require_int(n.rank, 0, kMaxRanks));
  if (e.rank >= e.world_size) {
    throw InvalidArgument(str(n.rank, "=", e.rank, " is out of range for ", n.size, "=",
                              e.world_size, " (ranks are 0..", e.world_size - 1, ")"));
  }
  e.local_rank = static_cast<int>(get_int(n.local_rank, e.rank, 0, kMaxRanks));
  // SLURM_NTASKS_PER_NODE may read "4(x2)" on heterogeneous allocations; take the leading count.
  auto local_size_text = get(n.local_size);
  if (local_size_text) {
    std::string digits = local_size_text->substr(0, local_size_text->find('('));
    e.local_world_size = static_cast<int>(parse_int(n.local_size, digits, 1, kMaxRanks));
  } else {
    e.local_world_size = e.world_size;
  }
  if (e.local_rank >= e.local_world_size) {
    throw InvalidArgument(str(n.local_rank, "=", e.local_rank, " is out of range for ",
                              n.local_size, "=", e.local_world_size));
  }
  e.group_rank = static_cast<int>(get_int("GROUP_RANK", e.rank / e.local_world_size, 0, kMaxRanks));
  return e;
}

}  // namespace

DistEnv read_dist_env() {
  if (get("RANK")) return read_with(kTorchrun);
  if (get("SLURM_PROCID") && get("SLURM_NTASKS")) return read_with(kSlurm);
  if (get("OMPI_COMM_WORLD_RANK")) return read_with(kOpenMpi);
  throw InvalidArgument(
      "environment variable RANK is not set (nor SLURM_PROCID or OMPI_COMM_WORLD_RANK): start "
      "workers with tdist-run, srun or mpirun, or set RANK and WORLD_SIZE");
}

MasterAddress read_master_address() {
  MasterAddress m;
  m.host = require("MASTER_ADDR");
  m.port = static_cast<uint16_t>(require_int("MASTER_PORT", 1, 65535));
  return m;
}

}  // namespace tdist::env
