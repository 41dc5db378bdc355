// tdist-run in place of torchrun: the command lines of torchrun's documentation run unchanged
// and give the workers the variables torchrun gives them (compared against torchrun itself, the
// wheel's torch.distributed.run under the Python the build found); a failed worker is reported
// from its TORCHELASTIC_ERROR_FILE as torchrun reports it; the output flags and the Python modes.
// The workers are small Python scripts that import nothing heavy.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "tests/apps/programs.h"
#include "tests/harness/command.h"
#include "tests/harness/expect.h"
#include "tests/harness/net.h"
#include "tests/harness/process.h"

namespace tdist {
namespace {

using test::contains;
using test::run_command;

const std::string kBuildPython = TDIST_PYTHON;

// Writes its environment and argv to $DUMP_DIR/rank<RANK>.json.
constexpr const char* kEnvDump = R"(import json, os, sys
with open(os.path.join(os.environ["DUMP_DIR"], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({"env": dict(os.environ), "argv": sys.argv, "exe": sys.executable}, f)
)";

void put_script(const std::string& path, const std::string& text, mode_t mode = 0644) {
  std::ofstream(path) << text;
  ::chmod(path.c_str(), mode);
}

struct EnvDump {
  std::map<std::string, std::string> env;
  std::vector<std::string> argv;
  std::string exe;  // the interpreter itself (not a wrapper such as pyenv's shim)
};

std::map<int, EnvDump> read_dumps(const std::string& dir, int world) {
  std::map<int, EnvDump> dumps;
  for (int r = 0; r < world; ++r) {
    std::ifstream in(dir + "/rank" + std::to_string(r) + ".json");
    if (!in) continue;
    auto j = nlohmann::json::parse(in);
    dumps[r] = {j["env"].get<std::map<std::string, std::string>>(),
                j["argv"].get<std::vector<std::string>>(), j["exe"].get<std::string>()};
  }
  return dumps;
}

// The scripts in a directory of their own, and what the interpreter alone puts in a worker's
// environment (so that what a launcher adds can be told apart).
class TorchrunCompat : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::temp_dir("tdist-torchrun");
    put_script(dir_ + "/envdump.py", kEnvDump);
    // The interpreter itself, not a wrapper such as pyenv's shim, which changes the
    // environment of what it runs: torchrun, the workers and the reference all run under it.
    auto exe = run_command({kBuildPython, "-c", "import sys; print(sys.executable)"});
    ASSERT_EQ(exe.exit_code, 0) << exe.describe();
    python_ = exe.out.substr(0, exe.out.find('\n'));
    put_script(dir_ + "/envdump_exe", "#!" + python_ + "\n" + kEnvDump, 0755);
    const std::string base = dir_ + "/base";
    ::mkdir(base.c_str(), 0755);
    auto r = run_command({python_, dir_ + "/envdump.py"},
                         test::with_timeout(60, env({{"DUMP_DIR", base}, {"RANK", "0"}})));
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    base_env_ = read_dumps(base, 1).at(0).env;
    base_env_.erase("RANK");
  }

  // The test's environment for a launcher: the dump directory, the scripts' directory on
  // PYTHONPATH (for -m), and tdist-run's Python (TDIST_PYTHON; torchrun uses its own).
  std::map<std::string, std::string> env(std::map<std::string, std::string> extra) const {
    extra["PYTHONPATH"] = dir_;
    extra["TDIST_PYTHON"] = python_;
    return extra;
  }

  // Runs `launchers` (each a full command line) at once; returns each one's dumps by rank.
  std::vector<std::map<int, EnvDump>> launch_all(
      const std::string& name, const std::vector<std::vector<std::string>>& launchers, int world) {
    std::vector<std::string> dumps;
    std::vector<test::CommandResult> results(launchers.size());
    std::vector<std::thread> threads;
    const std::string dump = dir_ + "/" + name;
    ::mkdir(dump.c_str(), 0755);
    for (size_t i = 0; i < launchers.size(); ++i) {
      threads.emplace_back([&, i] {
        auto opts = test::with_timeout(90, env({{"DUMP_DIR", dump}}));
        opts.cwd = dir_;
        results[i] = run_command(launchers[i], opts);
      });
    }
    for (auto& t : threads) t.join();
    for (const auto& r : results) EXPECT_EQ(r.exit_code, 0) << name << ": " << r.describe();
    auto got = read_dumps(dump, world);
    EXPECT_EQ(got.size(), static_cast<size_t>(world)) << name << ": every rank ran once";
    return {got};
  }

  // What the launcher put in a worker's environment: what differs from the interpreter's own.
  std::map<std::string, std::string> added(const EnvDump& d) const {
    std::map<std::string, std::string> out;
    for (const auto& [k, v] : d.env) {
      auto it = base_env_.find(k);
      if (it == base_env_.end() || it->second != v) out[k] = v;
    }
    out.erase("DUMP_DIR");
    return out;
  }

  // Runs `args` under torchrun and under tdist-run (one command line each, or `nodes` of them
  // with {node} replaced by the node's rank) and compares every rank's variables: each one
  // torchrun sets, tdist-run sets to the same value, except `chosen` (picked by each launcher:
  // checked to be set, and the same on every rank of a launch); tdist-run adds only TDIST_*.
  void compare(const std::string& name, const std::vector<std::string>& args, int world,
               const std::set<std::string>& chosen, int nodes = 1) {
    auto run = [&](const std::string& which, std::vector<std::string> prefix) {
      std::vector<std::vector<std::string>> cmds;
      for (int node = 0; node < nodes; ++node) {
        std::vector<std::string> cmd = prefix;
        for (auto a : args) {
          if (auto p = a.find("{node}"); p != std::string::npos)
            a.replace(p, 6, std::to_string(node));
          cmd.push_back(a);
        }
        cmds.push_back(cmd);
      }
      return launch_all(name + "_" + which, cmds, world).at(0);
    };
    const auto torch = run("torchrun", {python_, "-m", "torch.distributed.run"});
    const auto ours = run("tdist-run", {test::kRun});
    ASSERT_EQ(torch.size(), static_cast<size_t>(world));
    ASSERT_EQ(ours.size(), static_cast<size_t>(world));
    std::map<std::string, std::set<std::string>> chosen_values;
    std::set<std::string> error_files;
    for (int r = 0; r < world; ++r) {
      const auto want = added(torch.at(r));
      const auto got = added(ours.at(r));
      EXPECT_EQ(ours.at(r).argv, torch.at(r).argv) << name << " rank " << r;
      for (const auto& [k, v] : want) {
        auto it = got.find(k);
        if (it == got.end()) {
          ADD_FAILURE() << name << " rank " << r << ": tdist-run does not set " << k
                        << " (torchrun: " << v << ")";
        } else if (k == "TORCHELASTIC_ERROR_FILE") {
          EXPECT_TRUE(error_files.insert(it->second).second)
              << "an error file per worker: " << it->second;
        } else if (k == "TORCHELASTIC_USE_AGENT_STORE") {
          EXPECT_EQ(it->second, "False") << "under tdist-run rank 0 hosts the workers' store";
        } else if (chosen.count(k)) {
          EXPECT_FALSE(it->second.empty()) << k;
          chosen_values[k].insert(it->second);
        } else {
          EXPECT_EQ(it->second, v) << name << " rank " << r << ": " << k;
        }
      }
      for (const auto& [k, v] : got) {
        EXPECT_TRUE(want.count(k) || k.rfind("TDIST_", 0) == 0)
            << name << " rank " << r << ": tdist-run sets " << k << "=" << v
            << ", torchrun does not";
      }
    }
    for (const auto& [k, values] : chosen_values) {
      EXPECT_EQ(values.size(), 1u) << k << " is the same on every rank of a launch";
    }
  }

  std::string dir_;
  std::string python_;
  std::map<std::string, std::string> base_env_;
};

// torchrun's documentation, "Single-node multi-worker".
TEST_F(TorchrunCompat, SingleNodeStandaloneGivesTorchrunsVariables) {
  compare("standalone",
          {"--standalone", "--nnodes=1", "--nproc-per-node=2", "envdump.py", "--arg1", "x"}, 2,
          {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"});
}

// The static multi-node form (--node-rank, --master-addr, --master-port): two launchers on
// loopback, one worker each.
TEST_F(TorchrunCompat, TwoStaticNodesGiveTorchrunsVariables) {
  const std::string port = std::to_string(test::free_port());
  compare("static",
          {"--nnodes=2", "--node-rank={node}", "--nproc-per-node=1", "--master-addr=127.0.0.1",
           "--master-port=" + port, "envdump.py"},
          2, {}, 2);
}

// torchrun's documentation, "Elastic (min=1, max=4)", with min 1 and max 2 on one node; the
// last call is shortened so that the round starts soon.
TEST_F(TorchrunCompat, ElasticOneToTwoNodesGivesTorchrunsVariables) {
  const std::string endpoint = "127.0.0.1:" + std::to_string(test::free_port());
  compare("elastic",
          {"--nnodes=1:2", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-id=job45",
           "--rdzv-backend=c10d", "--rdzv-endpoint=" + endpoint, "--rdzv-conf=last_call_timeout=1",
           "envdump.py"},
          2, {"MASTER_ADDR", "MASTER_PORT"});
}

TEST_F(TorchrunCompat, ModuleRunsUnderPythonDashM) {
  compare("module", {"--standalone", "--nproc-per-node=2", "-m", "envdump", "--arg1", "x"}, 2,
          {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"});
}

TEST_F(TorchrunCompat, NoPythonExecutesTheProgramItself) {
  compare(
      "no_python",
      {"--standalone", "--nproc-per-node=2", "--no-python", dir_ + "/envdump_exe", "--arg1", "x"},
      2, {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"});
}

// Note [Worker error files]: the exception a worker's @record wrote is what the launcher reports,
// in torchrun's layout, and it exits 1 as torchrun does.
TEST_F(TorchrunCompat, AWorkersRecordedExceptionIsReportedAsTorchrunDoes) {
  put_script(dir_ + "/fail.py", R"(import os, sys
if os.environ["RANK"] != "1":
    sys.exit(0)
from torch.distributed.elastic.multiprocessing.errors import record
@record
def main():
    raise ValueError("boom from rank 1")
main()
)");
  auto opts = test::with_timeout(90);
  opts.cwd = dir_;
  auto r = run_command(
      {test::kRun, "--nproc-per-node=2", "--master-port=0", "--python", kBuildPython, "fail.py"},
      opts);
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  for (const char* want :
       {"fail.py FAILED", "Root Cause (first observed failure):", "  <NO_OTHER_FAILURES>",
        "rank      : 1 (local_rank: 1)", "exitcode  : 1 (pid: ", "rank_1.error.json",
        "  ValueError: boom from rank 1", "raise ValueError(\"boom from rank 1\")"}) {
    EXPECT_TRUE(contains(r.err, want)) << "'" << want << "' not in: " << r.err;
  }
}

// Without an error file: the signal, or torchrun's pointer to @record; a file that is not the
// JSON is named as such. None of them keeps the launcher from reporting.
TEST_F(TorchrunCompat, FailuresWithoutAUsableErrorFileAreStillReported) {
  auto killed =
      run_command({test::kRun, "--nproc-per-node=1", "--master-port=0", "sh", "-c", "kill -9 $$"});
  EXPECT_EQ(killed.exit_code, 1) << killed.describe();
  EXPECT_TRUE(contains(killed.err, "exitcode  : -9 (pid: ")) << killed.err;
  EXPECT_TRUE(contains(killed.err, "error_file: <N/A>")) << killed.err;
  EXPECT_TRUE(contains(killed.err, "traceback : Signal 9 (SIGKILL) received by PID")) << killed.err;

  auto garbled = run_command({test::kRun, "--nproc-per-node=1", "--master-port=0", "sh", "-c",
                              "echo '{\"message\": 3' > \"$TORCHELASTIC_ERROR_FILE\"; exit 3"});
  EXPECT_EQ(garbled.exit_code, 1) << garbled.describe();
  EXPECT_TRUE(contains(garbled.err, "exitcode  : 3 (pid: ")) << garbled.err;
  EXPECT_TRUE(contains(garbled.err, "the error file is not torch.distributed.elastic's JSON"))
      << garbled.err;

  auto silent =
      run_command({test::kRun, "--nproc-per-node=1", "--master-port=0", "sh", "-c", "exit 5"});
  EXPECT_EQ(silent.exit_code, 1) << silent.describe();
  EXPECT_TRUE(contains(silent.err, "traceback : To enable traceback see:")) << silent.err;
}

// --run-path runs the script by runpy in the Python of --python; a .py PROGRAM runs under the
// Python that TDIST_PYTHON names; a missing one is a clear worker failure.
TEST_F(TorchrunCompat, RunPathAndThePythonThatRunsScripts) {
  put_script(dir_ + "/show.py", "import sys\nprint('ran', __name__, sys.argv[1:])\n");
  auto opts = test::with_timeout(60);
  opts.cwd = dir_;
  auto r = run_command({test::kRun, "--nproc-per-node=1", "--master-port=0", "--python",
                        kBuildPython, "--run-path", dir_ + "/show.py", "a", "b"},
                       opts);
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_TRUE(contains(r.out, "[rank 0] ran __main__ ['a', 'b']")) << r.out;

  opts.env = {{"TDIST_PYTHON", "/no/such/python"}};
  auto missing =
      run_command({test::kRun, "--nproc-per-node=1", "--master-port=0", "show.py"}, opts);
  EXPECT_EQ(missing.exit_code, 1) << missing.describe();
  EXPECT_TRUE(contains(missing.err, "cannot execute '/no/such/python'")) << missing.err;
}

// --redirects sends streams to the log files only, --tee to both, --local-ranks-filter keeps
// other ranks off the console (their files are written all the same).
TEST_F(TorchrunCompat, RedirectsTeeAndLocalRanksFilterChooseWhatReachesTheConsole) {
  const std::string logs = dir_ + "/logs";
  auto r = run_command({test::kRun, "--nproc-per-node=3", "--master-port=0", "--log-dir", logs,
                        "-r", "0:3,1:3", "-t", "1:2", "--local-ranks-filter", "0,1", "sh", "-c",
                        "echo out $RANK; echo err $RANK >&2"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_FALSE(contains(r.out + r.err, "[rank 0]")) << "rank 0 is redirected: " << r.describe();
  EXPECT_FALSE(contains(r.out, "[rank 1] out 1")) << r.out;
  EXPECT_TRUE(contains(r.err, "[rank 1] err 1")) << "rank 1's stderr is teed: " << r.err;
  EXPECT_FALSE(contains(r.out + r.err, "[rank 2]")) << "rank 2 is filtered out: " << r.describe();
  for (int rank = 0; rank < 3; ++rank) {
    std::ifstream out(logs + "/attempt_0/rank_" + std::to_string(rank) + ".stdout");
    std::string o;
    std::getline(out, o);
    EXPECT_EQ(o, "out " + std::to_string(rank));
  }

  // Without --log-dir, redirected output goes to a directory the launcher makes and names.
  auto tmp = run_command({test::kRun, "--nproc-per-node=1", "--master-port=0", "--redirects", "3",
                          "sh", "-c", "echo hidden"},
                         test::with_timeout(60, {{"TMPDIR", dir_}}));
  ASSERT_EQ(tmp.exit_code, 0) << tmp.describe();
  EXPECT_FALSE(contains(tmp.out, "hidden")) << tmp.out;
  const std::string marker = "tdist-run: log directory: ";
  ASSERT_TRUE(contains(tmp.err, marker)) << tmp.err;
  std::string made = tmp.err.substr(tmp.err.find(marker) + marker.size());
  made = made.substr(0, made.find('\n'));
  std::ifstream hidden(made + "/attempt_0/rank_0.stdout");
  std::string line;
  std::getline(hidden, line);
  EXPECT_EQ(line, "hidden");
}

// --nproc-per-node cpu and auto give as many workers as torchrun gives (here: no GPU for auto,
// or one per GPU), with torchrun's variables; --start-method and --logs-specs default are taken.
TEST_F(TorchrunCompat, NprocPerNodeCpuAndAutoStartMethodAndLogsSpecsAsTorchrun) {
  auto count = run_command({python_, "-c",
                            "import os, torch; print(os.cpu_count(), torch.cuda.device_count() "
                            "if torch.cuda.is_available() else 0)"},
                           test::with_timeout(60));
  ASSERT_EQ(count.exit_code, 0) << count.describe();
  int cpus = 0, gpus = 0;
  ASSERT_EQ(std::sscanf(count.out.c_str(), "%d %d", &cpus, &gpus), 2) << count.out;
  const int auto_world = gpus > 0 ? gpus : cpus;
  if (cpus > 4 || auto_world > 4) {
    GTEST_SKIP() << "cpu/auto would start " << cpus << "/" << auto_world
                 << " workers per launcher; the tests keep to 4";
  }
  const std::set<std::string> chosen = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"};
  compare("nproc_cpu",
          {"--standalone", "--nproc-per-node=cpu", "--start-method=fork", "--logs-specs=default",
           "envdump.py"},
          cpus, chosen);
  compare("nproc_auto",
          {"--standalone", "--nproc-per-node", "auto", "--start_method", "spawn", "envdump.py"},
          auto_world, chosen);
}

// What torchrun rejects after parsing (its ValueError: exit 1) and what its argparse rejects
// (exit 2): tdist-run exits with the same code, saying why.
TEST_F(TorchrunCompat, NprocPerNodeStartMethodAndLogsSpecsErrorsExitAsTorchrun) {
  struct Case {
    std::vector<std::string> args;
    std::string message;  // in tdist-run's stderr
  };
  std::vector<Case> cases = {
      {{"--nproc-per-node=many"}, "Unsupported nproc_per_node value: many"},
      {{"--logs-specs=nosuch"}, "--logs-specs 'nosuch': tdist-run cannot load"},
      {{"--start-method=thread"}, "--start-method"},
  };
  auto gpus = run_command({python_, "-c", "import torch; print(torch.cuda.device_count())"},
                          test::with_timeout(60));
  ASSERT_EQ(gpus.exit_code, 0) << gpus.describe();
  if (gpus.out.rfind("0", 0) == 0) {
    cases.push_back({{"--nproc-per-node=gpu"}, "Cuda is not available"});
  }
  for (const auto& c : cases) {
    std::vector<std::string> torchrun = {python_, "-m", "torch.distributed.run", "--standalone"};
    std::vector<std::string> ours = {test::kRun, "--standalone"};
    for (auto* cmd : {&torchrun, &ours}) {
      cmd->insert(cmd->end(), c.args.begin(), c.args.end());
      cmd->insert(cmd->end(), {"--no-python", "true"});
    }
    auto want = run_command(torchrun, test::with_timeout(60));
    auto got = run_command(ours, test::with_timeout(60));
    EXPECT_NE(want.exit_code, 0) << c.args[0] << ": " << want.describe();
    EXPECT_EQ(got.exit_code, want.exit_code)
        << c.args[0] << ": torchrun " << want.describe() << "\ntdist-run " << got.describe();
    EXPECT_TRUE(contains(got.err, c.message)) << "'" << c.message << "' not in: " << got.err;
  }
}

// A signal to the launcher: both forward it to the workers, stop them and exit 1 (torchrun's
// agent raises SignalException, and Python exits 1).
TEST_F(TorchrunCompat, ASignalStopsTheWorkersAndBothLaunchersExitOne) {
  for (const std::string which : {"torchrun", "tdist-run"}) {
    const std::string ready = dir_ + "/ready_" + which + "_";
    std::vector<std::string> cmd =
        which == "torchrun" ? std::vector<std::string>{python_, "-m", "torch.distributed.run"}
                            : std::vector<std::string>{test::kRun};
    cmd.insert(cmd.end(), {"--standalone", "--nproc-per-node=2", "--no-python", "sh", "-c",
                           "touch " + ready + "$RANK; exec sleep 120"});
    std::thread killer;
    auto opts = test::with_timeout(90);
    opts.on_start = [&](pid_t pid) {
      killer = std::thread([ready, pid] {
        for (int i = 0; i < 6000; ++i) {  // both workers up (at most a minute), then signal
          if (::access((ready + "0").c_str(), F_OK) == 0 &&
              ::access((ready + "1").c_str(), F_OK) == 0)
            break;
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        ::kill(pid, SIGTERM);
      });
    };
    auto r = run_command(cmd, opts);
    killer.join();
    ASSERT_FALSE(r.timed_out) << which << ": " << r.describe();
    EXPECT_EQ(::access((ready + "0").c_str(), F_OK), 0) << which << ": workers started";
    EXPECT_EQ(r.exit_code, 1) << which << ": " << r.describe();
    if (which == "tdist-run") {
      EXPECT_TRUE(contains(r.err, "stopped by SIGTERM")) << r.err;
    }
  }
}

TEST_F(TorchrunCompat, BadTorchrunFlagsExitWithTwo) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--no-python", "-m", "mod"}, "-m/--module cannot be used together"},
      {{"--redirects", "4", "true"}, "--redirects '4' is not 0-3"},
      {{"--tee", "0:1,x", "true"}, "is not LOCAL_RANK:0-3"},
      {{"--local-ranks-filter", "0,a", "true"}, "comma-separated list of local ranks"},
      {{"--no-tee", "true"}, "--no-tee: needs --log-dir"},
      {{"--rdzv-endpoint", "127.0.0.1:0", "true"}, "0 only with --rdzv-backend c10d --nnodes 1"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {test::kRun};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    auto r = run_command(argv);
    EXPECT_EQ(r.exit_code, 2) << c.args[0] << ": " << r.describe();
    EXPECT_TRUE(contains(r.err, c.message)) << "'" << c.message << "' not in: " << r.err;
  }
}

}  // namespace
}  // namespace tdist
