#pragma once
// Environment and configuration parsing. Every bad value gives an InvalidArgument that names the
// variable, the value and what was expected ("MASTER_PORT='abc' is not an integer in [1, 65535]").

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

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
// True when a launcher's variables are there for read_dist_env (RANK, Slurm's or Open MPI's).
bool has_dist_env();

// The CPUs this process may run on (its affinity mask), in increasing order; empty when the mask
// cannot be read.
std::vector<int> allowed_cpus();

// MASTER_ADDR and MASTER_PORT (1..65535). When unset inside a Slurm job, MASTER_ADDR defaults to
// the first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST) and MASTER_PORT to
// slurm_default_port(SLURM_JOB_ID), so that `srun tdist-train` needs no variable of its own.
// InvalidArgument when neither is available.
struct MasterAddress {
  std::string host;
  uint16_t port = 0;
};
MasterAddress read_master_address();

// Expands a Slurm host list: "node[1-3,5],gpu07,rack[01-02]-ib" -> node1 node2 node3 node5
// gpu07 rack01-ib rack02-ib (zero padding kept; one bracket group per name). InvalidArgument
// (naming the list) on a malformed list or more than `max_hosts` names.
std::vector<std::string> expand_slurm_nodelist(const std::string& list, size_t max_hosts = 1 << 20);

// The port every task of Slurm job `job_id` derives alike: 20000 + job_id mod 20000.
int slurm_default_port(int64_t job_id);

// Inside an srun step (SLURM_STEP_NUM_NODES, SLURM_NODEID and SLURM_STEP_NODELIST set): the
// node count, this node's index, the first host of the step and slurm_default_port(SLURM_JOB_ID).
struct SlurmStep {
  int num_nodes = 1;
  int node_id = 0;
  std::string first_host;
  int port = 0;
};
std::optional<SlurmStep> read_slurm_step();

}  // namespace tdist::env
