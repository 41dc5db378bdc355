// Where users run tdist (docs/deploy.md): the environments that Slurm's srun and Kubeflow's
// PyTorchJob operator give a process, reproduced on one host without Slurm or Kubernetes.
// Every "task" or "pod" is a real process that sees only what srun or the operator would set.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "tdist/core/env.h"
#include "tests/apps/programs.h"
#include "tests/harness/command.h"
#include "tests/harness/net.h"

namespace tdist {
namespace {

using Env = std::map<std::string, std::string>;

using test::kRun;
using test::kTrain;
const std::string kSourceDir = TDIST_SOURCE_DIR;

// What a launcher would have set, emptied (an empty variable counts as unset: core/env.h).
Env without_launcher_vars() {
  Env e;
  for (const char* k : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                        "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID",
                        "SLURM_NTASKS", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                        "SLURM_STEP_NUM_NODES", "SLURM_NODEID", "SLURM_JOB_ID"}) {
    e[k] = "";
  }
  return e;
}

// Runs one command per environment, all at once, and returns their results in order.
std::vector<test::CommandResult> run_all(const std::vector<std::string>& argv,
                                         const std::vector<Env>& envs) {
  std::vector<test::CommandResult> results(envs.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < envs.size(); ++i) {
    threads.emplace_back([&, i] {
      test::CommandOptions o;
      o.timeout = std::chrono::seconds(90);
      o.env = without_launcher_vars();
      o.env["OMP_NUM_THREADS"] = "1";
      for (const auto& [k, v] : envs[i]) o.env[k] = v;
      results[i] = test::run_command(argv, o);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

// A Slurm job id whose derived port (env::slurm_default_port) is free now.
std::string slurm_job_id_with_free_port() {
  for (int i = 0; i < 1000; ++i) {
    const int port = test::free_port();
    if (port >= 20000 && port < 40000) return std::to_string(3000000 + (port - 20000));
  }
  ADD_FAILURE() << "no free port in [20000, 40000)";
  return "0";
}

const std::vector<std::string> kTrainArgs = {"--steps",         "10",   "--hidden",       "32",
                                             "--layers",        "1",    "--test-samples", "200",
                                             "--train-samples", "2000", "--progress",     "none"};

// Every rank 0..world-1 printed "rank r of world: trained", and all with the same parameters.
void expect_trained_together(const std::string& out, int world) {
  for (int r = 0; r < world; ++r) {
    const std::string want =
        "rank " + std::to_string(r) + " of " + std::to_string(world) + ": trained 10 steps";
    EXPECT_NE(out.find(want), std::string::npos) << "missing '" << want << "' in:\n" << out;
  }
  std::set<std::string> hashes;
  std::regex hash(R"(parameters fnv1a64 ([0-9a-f]+))");
  for (std::sregex_iterator it(out.begin(), out.end(), hash), end; it != end; ++it)
    hashes.insert((*it)[1]);
  EXPECT_EQ(hashes.size(), 1u) << "the ranks ended with different parameters:\n" << out;
}

TEST(Launch, SrunTdistTrainFromSlurmVariablesAlone) {
  const std::string job = slurm_job_id_with_free_port();
  std::vector<Env> tasks;
  for (int i = 0; i < 2; ++i) {
    tasks.push_back({{"SLURM_PROCID", std::to_string(i)},
                     {"SLURM_NTASKS", "2"},
                     {"SLURM_LOCALID", std::to_string(i)},
                     {"SLURM_NTASKS_PER_NODE", "2"},
                     {"SLURM_NODEID", "0"},
                     {"SLURM_STEP_NODELIST", "localhost"},
                     {"SLURM_JOB_NODELIST", "localhost"},
                     {"SLURM_JOB_ID", job}});
  }
  std::vector<std::string> argv = {kTrain};
  argv.insert(argv.end(), kTrainArgs.begin(), kTrainArgs.end());
  auto results = run_all(argv, tasks);
  std::string out;
  for (const auto& r : results) {
    EXPECT_TRUE(r.exited && r.exit_code == 0) << r.describe();
    out += r.out;
  }
  expect_trained_together(out, 2);
}

TEST(Launch, SrunTdistRunFromSlurmVariablesAlone) {
  // srun --nodes 2 --ntasks-per-node 1 tdist-run --nproc-per-node 2 tdist-train ...
  const std::string job = slurm_job_id_with_free_port();
  std::vector<Env> nodes;
  for (int i = 0; i < 2; ++i) {
    nodes.push_back({{"SLURM_PROCID", std::to_string(i)},
                     {"SLURM_NTASKS", "2"},
                     {"SLURM_LOCALID", "0"},
                     {"SLURM_NODEID", std::to_string(i)},
                     {"SLURM_STEP_NUM_NODES", "2"},
                     {"SLURM_STEP_NODELIST", "localhost,127.0.0.1"},
                     {"SLURM_JOB_ID", job}});
  }
  std::vector<std::string> argv = {kRun, "--nproc-per-node", "2", kTrain};
  argv.insert(argv.end(), kTrainArgs.begin(), kTrainArgs.end());
  auto results = run_all(argv, nodes);
  std::string out;
  for (const auto& r : results) {
    EXPECT_TRUE(r.exited && r.exit_code == 0) << r.describe();
    out += r.out;
  }
  expect_trained_together(out, 4);
}

// The container's entry command (examples/kubernetes/Dockerfile), as the test runs it.
std::vector<std::string> dockerfile_entrypoint() {
  std::ifstream in(kSourceDir + "/examples/kubernetes/Dockerfile");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("ENTRYPOINT ", 0) == 0) {
      std::vector<std::string> argv;
      std::regex word(R"re("([^"]*)")re");
      for (std::sregex_iterator it(line.begin(), line.end(), word), end; it != end; ++it)
        argv.push_back((*it)[1]);
      return argv;
    }
  }
  return {};
}

TEST(Launch, KubeflowPyTorchJobEnvDrivesTdistRun) {
  const auto entry = dockerfile_entrypoint();
  ASSERT_EQ(entry, (std::vector<std::string>{"tdist-run"}))
      << "this test runs the image's entry command; update it with the Dockerfile";
  const std::string port = std::to_string(test::free_port());
  // What the training operator sets in the master pod (index 0) and the worker pod (index 1)
  // of a PyTorchJob with nprocPerNode 2: node-level RANK/WORLD_SIZE and torchrun's PET_*.
  std::vector<Env> pods;
  for (int i = 0; i < 2; ++i) {
    pods.push_back({{"MASTER_ADDR", "localhost"},
                    {"MASTER_PORT", port},
                    {"RANK", std::to_string(i)},
                    {"WORLD_SIZE", "2"},
                    {"PET_NNODES", "2"},
                    {"PET_NPROC_PER_NODE", "2"},
                    {"PET_NODE_RANK", std::to_string(i)},
                    {"PET_MASTER_ADDR", "localhost"},
                    {"PET_MASTER_PORT", port}});
  }
  std::vector<std::string> argv = {kRun, kTrain};  // ENTRYPOINT, then the manifest's args
  argv.insert(argv.end(), kTrainArgs.begin(), kTrainArgs.end());
  auto results = run_all(argv, pods);
  std::string out;
  for (const auto& r : results) {
    EXPECT_TRUE(r.exited && r.exit_code == 0) << r.describe();
    out += r.out;
  }
  expect_trained_together(out, 4);
}

TEST(Launch, KubeflowElasticPolicyEnvDrivesTdistRun) {
  // An elasticPolicy (rdzvBackend c10d, minReplicas = maxReplicas = 2): no PET_MASTER_*, the
  // rendezvous variables instead.
  const std::string endpoint = "127.0.0.1:" + std::to_string(test::free_port());
  std::vector<Env> pods(2, Env{{"PET_NNODES", "2:2"},
                               {"PET_NPROC_PER_NODE", "1"},
                               {"PET_RDZV_BACKEND", "c10d"},
                               {"PET_RDZV_ENDPOINT", endpoint},
                               {"PET_RDZV_ID", "tdist-train"},
                               {"PET_MAX_RESTARTS", "1"}});
  std::vector<std::string> argv = {kRun, kTrain};
  argv.insert(argv.end(), kTrainArgs.begin(), kTrainArgs.end());
  auto results = run_all(argv, pods);
  std::string out;
  for (const auto& r : results) {
    EXPECT_TRUE(r.exited && r.exit_code == 0) << r.describe();
    EXPECT_NE(r.err.find("elastic rendezvous 'tdist-train'"), std::string::npos) << r.err;
    out += r.out;
  }
  expect_trained_together(out, 2);
}

}  // namespace
}  // namespace tdist
