#include "apps/bench/anchors.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "apps/bench/common.h"
#include "tdist/core/error.h"

namespace tdist::bench {
namespace {

std::string mpi_program() {
  const std::string exe = self_exe();
  return exe.substr(0, exe.find_last_of('/') + 1) + "tdist-bench-mpi";
}

std::vector<double> run_mpi(const AnchorRun& run) {
  std::ostringstream cmd;
  cmd << "mpirun --oversubscribe --allow-run-as-root -np " << run.world << " -x OMP_NUM_THREADS=1 '"
      << mpi_program() << "' " << run.op << " " << run.warmup << " " << run.iters;
  for (size_t b : run.bytes) cmd << " " << b;
  cmd << " 2>&1";
  int status = 0;
  const std::string out = capture_output(cmd.str(), &status);
  std::vector<double> times;
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    unsigned long long bytes = 0;
    double us = 0;
    if (std::sscanf(line.c_str(), "%llu %lf", &bytes, &us) == 2 &&
        times.size() < run.bytes.size() && bytes == run.bytes[times.size()]) {
      times.push_back(us);
    }
  }
  if (status != 0 || times.size() != run.bytes.size()) {
    throw std::runtime_error("the Open MPI anchor failed (" + cmd.str() + "):\n" + out);
  }
  return times;
}

std::vector<double> run_gloo(const AnchorRun& run) {
  char tmpl[] = "/tmp/tdist-bench-gloo-XXXXXX";
  const int fd = ::mkstemp(tmpl);
  TDIST_CHECK(fd >= 0, "mkstemp failed");
  ::close(fd);
  const std::string json_path = tmpl;
  std::ostringstream step;
  step << run.step_factor;
  const int port = free_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < run.world; ++r) {
    pids.push_back(spawn_process(
        {run.python, find_script("bench_gloo.py"), "--worker", "--op", run.op, "--min-bytes",
         run.min_bytes, "--max-bytes", run.max_bytes, "--step-factor", step.str(), "--iters",
         std::to_string(run.iters), "--warmup", std::to_string(run.warmup), "--json", json_path},
        {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(run.world),
         "LOCAL_RANK=" + std::to_string(r), "MASTER_ADDR=127.0.0.1",
         "MASTER_PORT=" + std::to_string(port), "OMP_NUM_THREADS=1"},
        "gloo rank " + std::to_string(r)));
  }
  std::string failed;
  for (int r = 0; r < run.world; ++r) {
    int status = 0;
    ::waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed += " " + std::to_string(r);
  }
  nlohmann::json result;
  std::ifstream in(json_path);
  if (failed.empty() && in.good()) result = nlohmann::json::parse(in, nullptr, false);
  std::remove(json_path.c_str());
  if (!failed.empty()) throw std::runtime_error("the gloo anchor failed on rank(s)" + failed);
  std::vector<double> times;
  if (result.is_object() && result.contains("rows")) {
    for (const auto& row : result["rows"]) {
      if (times.size() < run.bytes.size() &&
          row["bytes"].get<size_t>() == run.bytes[times.size()]) {
        times.push_back(row["time_us"].get<double>());
      }
    }
  }
  if (times.size() != run.bytes.size()) {
    throw std::runtime_error("the gloo anchor reported other sizes than the tdist run");
  }
  return times;
}

}  // namespace

void check_anchor(const std::string& anchor, const std::string& dtype, const std::string& redop) {
  if (anchor == "none") return;
  TDIST_CHECK_ARG(dtype == "float32" && redop == "sum", "--anchor ", anchor,
                  " measures float32 sum only (got --dtype ", dtype, " --redop ", redop, ")");
  if (anchor == "mpi") {
    if (!in_path("mpirun")) {
      throw std::runtime_error(
          "--anchor mpi: mpirun is not in PATH (install Open MPI, e.g. "
          "apt-get install openmpi-bin libopenmpi-dev, and rebuild)");
    }
    if (::access(mpi_program().c_str(), X_OK) != 0) {
      throw std::runtime_error("--anchor mpi: " + mpi_program() +
                               " was not built (CMake found no MPI when this build was "
                               "configured; install Open MPI's development files and reconfigure)");
    }
  } else {
    const std::string script = find_script("bench_gloo.py");
    if (::access(script.c_str(), R_OK) != 0) {
      throw std::runtime_error("--anchor gloo: " + script + " not found");
    }
  }
}

std::vector<double> run_anchor(const AnchorRun& run) {
  return run.anchor == "mpi" ? run_mpi(run) : run_gloo(run);
}

}  // namespace tdist::bench
