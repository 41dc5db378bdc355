#include "tdist/core/env.h"

#include <sched.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>
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
  throw InvalidArgument(
      str(name, "='", *v, "' is not a boolean (1/0, true/false, yes/no, on/off)"));
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

bool has_dist_env() {
  return get("RANK") || (get("SLURM_PROCID") && get("SLURM_NTASKS")) || get("OMPI_COMM_WORLD_RANK");
}

DistEnv read_dist_env() {
  if (get("RANK")) return read_with(kTorchrun);
  if (get("SLURM_PROCID") && get("SLURM_NTASKS")) return read_with(kSlurm);
  if (get("OMPI_COMM_WORLD_RANK")) return read_with(kOpenMpi);
  throw InvalidArgument(
      "environment variable RANK is not set (nor SLURM_PROCID or OMPI_COMM_WORLD_RANK): start "
      "workers with tdist-run, srun or mpirun, or set RANK and WORLD_SIZE");
}

namespace {

std::optional<std::string> slurm_nodelist() {
  if (auto l = get("SLURM_STEP_NODELIST")) return l;
  return get("SLURM_JOB_NODELIST");
}

}  // namespace

MasterAddress read_master_address() {
  MasterAddress m;
  if (auto host = get("MASTER_ADDR")) {
    m.host = *host;
  } else if (auto list = slurm_nodelist()) {
    m.host = expand_slurm_nodelist(*list, 1).front();
  } else {
    throw InvalidArgument(
        "environment variable MASTER_ADDR is not set (nor SLURM_STEP_NODELIST or "
        "SLURM_JOB_NODELIST)");
  }
  if (get("MASTER_PORT") || !get("SLURM_JOB_ID")) {
    m.port = static_cast<uint16_t>(require_int("MASTER_PORT", 1, 65535));
  } else {
    m.port = static_cast<uint16_t>(slurm_default_port(require_int("SLURM_JOB_ID", 0, INT64_MAX)));
  }
  return m;
}

std::vector<std::string> expand_slurm_nodelist(const std::string& list, size_t max_hosts) {
  auto bad = [&](const std::string& why) -> InvalidArgument {
    return InvalidArgument(str("Slurm node list '", list, "': ", why));
  };
  std::vector<std::string> hosts;
  auto add = [&](std::string h) {
    if (hosts.size() >= max_hosts) return false;
    hosts.push_back(std::move(h));
    return true;
  };
  size_t pos = 0;
  while (pos < list.size()) {
    // One name: prefix[ranges]suffix or a plain name, up to a comma outside brackets.
    const size_t open = list.find_first_of("[,", pos);
    if (open == std::string::npos || list[open] == ',') {
      const size_t end = open == std::string::npos ? list.size() : open;
      if (end == pos) throw bad("empty name");
      if (!add(list.substr(pos, end - pos))) return hosts;
      pos = end + 1;
      continue;
    }
    const size_t close = list.find(']', open);
    if (close == std::string::npos) throw bad("unclosed '['");
    const std::string prefix = list.substr(pos, open - pos);
    size_t end = list.find(',', close);
    if (end == std::string::npos) end = list.size();
    const std::string suffix = list.substr(close + 1, end - close - 1);
    if (suffix.find_first_of("[]") != std::string::npos)
      throw bad("more than one '[...]' in a name");
    const std::string ranges = list.substr(open + 1, close - open - 1);
    size_t rpos = 0;
    while (rpos <= ranges.size()) {
      size_t comma = ranges.find(',', rpos);
      if (comma == std::string::npos) comma = ranges.size();
      const std::string range = ranges.substr(rpos, comma - rpos);
      const size_t dash = range.find('-');
      const std::string lo_text = range.substr(0, dash);
      const std::string hi_text = dash == std::string::npos ? lo_text : range.substr(dash + 1);
      auto number = [&](const std::string& t) {
        if (t.empty() || t.size() > 9 || t.find_first_not_of("0123456789") != std::string::npos)
          throw bad("'" + range + "' is not N or N-M");
        return std::stol(t);
      };
      const long lo = number(lo_text), hi = number(hi_text);
      if (hi < lo) throw bad("'" + range + "' runs backwards");
      for (long i = lo; i <= hi; ++i) {
        std::string digits = std::to_string(i);
        if (digits.size() < lo_text.size()) digits.insert(0, lo_text.size() - digits.size(), '0');
        if (!add(prefix + digits + suffix)) return hosts;
      }
      rpos = comma + 1;
    }
    pos = end + 1;
  }
  if (hosts.empty()) throw bad("no host");
  return hosts;
}

int slurm_default_port(int64_t job_id) { return static_cast<int>(20000 + job_id % 20000); }

std::optional<SlurmStep> read_slurm_step() {
  auto nodes = get("SLURM_STEP_NUM_NODES");
  auto list = get("SLURM_STEP_NODELIST");
  if (!nodes || !list || !get("SLURM_NODEID")) return std::nullopt;
  SlurmStep s;
  s.num_nodes = static_cast<int>(parse_int("SLURM_STEP_NUM_NODES", *nodes, 1, kMaxRanks));
  s.node_id = static_cast<int>(require_int("SLURM_NODEID", 0, s.num_nodes - 1));
  s.first_host = expand_slurm_nodelist(*list, 1).front();
  s.port = slurm_default_port(get_int("SLURM_JOB_ID", 0, 0, INT64_MAX));
  return s;
}

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

}  // namespace tdist::env
