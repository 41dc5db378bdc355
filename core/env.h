#pragma once
// Environment and configuration parsing. Every bad value gives an InvalidArgument that names the
// variable, the value and what was expected ("MASTER_PORT='abc' is not an integer in [1, 65535]").

#include <cstdint>
#include <optional>
#include <string>

namespace tdist::env {

// The variable's value, or nullopt when unset. An empty value counts as unset.
std::optional<std::string> get(const std::string& name);

// The variable's value; InvalidArgument when unset.
std::string require(const std::string& name);

// Parses `value` (named `name` in errors) as an integer in [min, max].
int64_t parse_int(const std::string& name, const std::string& value, int64_t min, int64_t max);

// Integer variable in [min, max]; `fallback` when unset.
int64_t get_int(const std::string& name, int64_t fallback, int64_t min, int64_t max);

// Integer variable in [min, max]; InvalidArgument when unset.
int64_t require_int(const std::string& name, int64_t min, int64_t max);

// 1/0, true/false, yes/no, on/off (case-insensitive); `fallback` when unset.
bool get_bool(const std::string& name, bool fallback);

// Where this process sits in the job. From RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// GROUP_RANK, MASTER_ADDR and MASTER_PORT (as tdist-run and torchrun set them); when RANK is
// absent, from SLURM (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE) or
// Open MPI (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE). Checks 0 <= rank < world_size
// and 0 <= local_rank < local_world_size.
struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int group_rank = 0;
  std::string source;  // "env", "slurm" or "openmpi": where rank and size came from
};
DistEnv read_dist_env();

// MASTER_ADDR (required) and MASTER_PORT (required, 1..65535).
struct MasterAddress {
  std::string host;
  uint16_t port = 0;
};
MasterAddress read_master_address();

}  // namespace tdist::env
