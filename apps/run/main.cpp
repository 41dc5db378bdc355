// tdist-run: a torchrun-like launcher.
//
//   tdist-run --nproc-per-node N|cpu|gpu|auto [--nnodes N --node-rank R] [--master-addr A] [--master-port P]
//             [--standalone] [--max-restarts K] [--log-dir DIR] [--redirects S] [--tee S]
//             [--local-ranks-filter R,...] [--role NAME] [--python PY] [-m | --no-python |
//             --run-path] PROGRAM ARGS...
//   tdist-run --nnodes MIN:MAX --rdzv-endpoint HOST[:PORT] --rdzv-id JOB [--rdzv-last-call S]
//             [--max-restarts K] ... PROGRAM ARGS...          (elastic: Note [Elastic rendezvous])
//
// torchrun's command lines run unchanged (docs/deploy.md, "From torchrun"): a PROGRAM ending in
// .py, or any with -m, runs under the Python of --python / TDIST_PYTHON (default python3) as
// `python -u [-m] PROGRAM ARGS`; --run-path runs it with runpy.run_path; --no-python, or a
// PROGRAM not ending in .py, is executed as it is.
//
// Defaults, lowest first: built in; inside an srun step, Slurm's (SLURM_STEP_NUM_NODES,
// SLURM_NODEID, the step's first host, a port from SLURM_JOB_ID); the PET_* variables that
// Kubeflow's PyTorchJob sets for torchrun (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
// PET_MASTER_ADDR, PET_MASTER_PORT, PET_RDZV_ENDPOINT, PET_RDZV_BACKEND, PET_RDZV_ID,
// PET_MAX_RESTARTS); then the flags. See docs/deploy.md.
//
// Exit codes: 0 all workers succeeded; 1 a worker failed (rank and exit code or signal are
// reported, with torchrun's report from the workers' error files); 2 bad flags (torchrun's
// argparse exits 2 as well); 1 stopped by a signal (forwarded to the workers; torchrun exits 1
// then too).
#include <CLI/CLI.hpp>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <stdexcept>

#include "apps/run/launcher.h"
#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/token.h"

namespace {

// "N" or "MIN:MAX" (torchrun's --nnodes).
std::pair<int, int> parse_nnodes(const std::string& text) {
  auto number = [&](const std::string& t) {
    try {
      return static_cast<int>(tdist::env::parse_int("--nnodes", t, 1, 65536));
    } catch (const tdist::InvalidArgument&) {
      throw CLI::ValidationError("--nnodes",
                                 "'" + text + "' is not N or MIN:MAX with 1 <= MIN <= MAX");
    }
  };
  const auto colon = text.find(':');
  if (colon == std::string::npos) return {number(text), number(text)};
  std::pair<int, int> mm{number(text.substr(0, colon)), number(text.substr(colon + 1))};
  if (mm.first > mm.second) {
    throw CLI::ValidationError("--nnodes",
                               "'" + text + "' is not N or MIN:MAX with 1 <= MIN <= MAX");
  }
  return mm;
}

// torchrun's --rdzv-conf (what Kubeflow passes as PET_RDZV_CONF): fills the values whose own
// flag was not given. Keys other than these four are ignored, as torchrun's c10d backend
// ignores the ones it does not use.
void apply_rdzv_conf(const std::string& conf, const CLI::App& app, double& last_call,
                     double& join_timeout, double& keep_alive, double& keep_alive_timeout) {
  double attempts = -1;
  size_t pos = 0;
  while (pos < conf.size()) {
    size_t comma = conf.find(',', pos);
    if (comma == std::string::npos) comma = conf.size();
    const std::string item = conf.substr(pos, comma - pos);
    pos = comma + 1;
    const auto eq = item.find('=');
    if (eq == std::string::npos)
      throw CLI::ValidationError("--rdzv-conf", "'" + item + "' is not KEY=VALUE");
    const std::string k = item.substr(0, eq);
    double v = 0;
    try {
      size_t used = 0;
      v = std::stod(item.substr(eq + 1), &used);
      if (used != item.size() - eq - 1 || !(v > 0)) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      throw CLI::ValidationError("--rdzv-conf", "'" + item + "' needs a positive number");
    }
    auto given = [&](const char* flag) { return app.count(flag) > 0; };
    if (k == "join_timeout" && !given("--rdzv-join-timeout")) join_timeout = v;
    if (k == "last_call_timeout" && !given("--rdzv-last-call")) last_call = v;
    if (k == "keep_alive_interval" && !given("--rdzv-keep-alive-interval")) keep_alive = v;
    if (k == "keep_alive_max_attempt") attempts = v;
  }
  if (attempts > 0 && app.count("--rdzv-keep-alive-timeout") == 0) {
    keep_alive_timeout = keep_alive * attempts;
  }
}

// torchrun's --local-ranks-filter: "0,1,2".
std::vector<int> parse_local_ranks(const std::string& text) {
  std::vector<int> ranks;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    try {
      ranks.push_back(static_cast<int>(
          tdist::env::parse_int("--local-ranks-filter", text.substr(pos, comma - pos), 0, 65535)));
    } catch (const tdist::InvalidArgument&) {
      throw CLI::ValidationError("--local-ranks-filter", "'" + text +
                                                             "' is not a comma-separated list "
                                                             "of local ranks, e.g. 0,1,2");
    }
    pos = comma + 1;
  }
  return ranks;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// What --run-path runs: the script by runpy.run_path in a fresh interpreter, as torchrun runs it
// in its worker process (sys.argv is the script and its arguments).
constexpr const char* kRunPathCode =
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')";

// The worker command for PROGRAM ARGS (see the top of this file); sets the report's name.
std::vector<std::string> worker_command(const std::vector<std::string>& rest,
                                        const std::string& python, bool module, bool no_python,
                                        bool run_path, std::string& name) {
  const std::string& script = rest[0];
  const std::vector<std::string> args(rest.begin() + 1, rest.end());
  std::vector<std::string> cmd;
  name = script;
  if (run_path) {
    cmd = {python, "-u", "-c", kRunPathCode, script};
    name = "run_script_path";  // torchrun's name for it
  } else if (no_python) {
    if (module)
      throw CLI::ValidationError("--no-python", "and -m/--module cannot be used together");
    cmd = {script};
  } else if (module || ends_with(script, ".py")) {
    cmd = {python, "-u"};
    if (module) cmd.push_back("-m");
    cmd.push_back(script);
  } else {
    cmd = {script};
  }
  cmd.insert(cmd.end(), args.begin(), args.end());
  return cmd;
}

// The CUDA devices this process may use (CUDA_VISIBLE_DEVICES applies), as the driver counts
// them; 0 without a driver or a device. libcuda is loaded only here, when --nproc-per-node asks
// for GPUs, and stays loaded (the driver does not support unloading); workers are exec'd, so
// they start without it.
int visible_cuda_devices() {
  void* driver = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!driver) return 0;
  using Init = int (*)(unsigned);
  using Count = int (*)(int*);
  auto init = reinterpret_cast<Init>(::dlsym(driver, "cuInit"));
  auto count = reinterpret_cast<Count>(::dlsym(driver, "cuDeviceGetCount"));
  int n = 0;
  if (!init || !count || init(0) != 0 || count(&n) != 0) return 0;
  return n;
}

// A flag torchrun accepts but then rejects by raising ValueError, which ends torchrun with 1
// (not argparse's 2): tdist-run reports it and exits 1 too.
struct TorchrunValueError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// torchrun's --nproc-per-node: a count; cpu, the CPUs online (os.cpu_count()); gpu, the CUDA
// devices visible (an error without one); auto, the GPUs if any, else the CPUs.
int resolve_nproc_per_node(const std::string& text) {
  if (!text.empty() && text.find_first_not_of("0123456789") == std::string::npos) {
    try {
      return static_cast<int>(tdist::env::parse_int("--nproc-per-node", text, 1, 4096));
    } catch (const tdist::InvalidArgument&) {
      throw CLI::ValidationError("--nproc-per-node", "'" + text + "' is not in [1, 4096]");
    }
  }
  auto cpus = [] { return static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN))); };
  if (text == "cpu") return cpus();
  if (text == "gpu" || text == "auto") {
    const int gpus = visible_cuda_devices();
    if (gpus > 0) return gpus;
    if (text == "auto") return cpus();
    throw TorchrunValueError(
        "--nproc-per-node gpu: Cuda is not available (no CUDA device is visible)");
  }
  throw TorchrunValueError("Unsupported nproc_per_node value: " + text +
                           " (a number, cpu, gpu or auto)");
}

std::chrono::milliseconds seconds(double s) {
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

}  // namespace

int main(int argc, char** argv) {
  tdist::run::LaunchConfig cfg;
  CLI::App app{"tdist-run: start one worker process per rank (torchrun's flags and variables)",
               "tdist-run"};
  app.prefix_command();  // everything from the program name on belongs to the program
  std::string endpoint;
  bool standalone = false;
  double monitor_interval_s = 0.1;
  double stop_grace_s = 5.0;
  bool no_tee = false;
  std::string tee, redirects, ranks_filter;
  std::string python = "python3";
  bool module = false, no_python = false, run_path = false;
  std::string nnodes = "1";
  std::string backend = "static";
  double last_call_s = 2.0, join_timeout_s = 600.0, keep_alive_s = 1.0, keep_alive_timeout_s = 10.0;
  try {
    if (auto slurm = tdist::env::read_slurm_step()) {
      nnodes = std::to_string(slurm->num_nodes);
      cfg.node_rank = slurm->node_id;
      cfg.master_addr = slurm->first_host;
      cfg.master_port = slurm->port;
    }
  } catch (const tdist::InvalidArgument& e) {
    std::cerr << "tdist-run: " << e.what() << "\n";
    return 2;
  }
  std::string nproc = "1";
  app.add_option("--nproc-per-node,--nproc_per_node", nproc,
                 "worker processes on this node: N, cpu (one per CPU), gpu (one per visible "
                 "CUDA device) or auto (gpu where there is one, else cpu)")
      ->envname("PET_NPROC_PER_NODE");
  app.add_option("--nnodes", nnodes, "number of nodes: N, or MIN:MAX for an elastic job")
      ->envname("PET_NNODES");
  app.add_option("--node-rank,--node_rank", cfg.node_rank, "this node's rank")
      ->envname("PET_NODE_RANK")
      ->check(CLI::Range(0, 65535));
  app.add_option("--master-addr,--master_addr", cfg.master_addr, "address of rank 0's store")
      ->envname("PET_MASTER_ADDR");
  app.add_option("--master-port,--master_port", cfg.master_port,
                 "port of rank 0's store (0: pick a free one)")
      ->envname("PET_MASTER_PORT")
      ->check(CLI::Range(0, 65535));
  app.add_option("--rdzv-endpoint,--rdzv_endpoint", endpoint,
                 "HOST:PORT of the store (static) or of the elastic rendezvous")
      ->envname("PET_RDZV_ENDPOINT");
  app.add_option("--rdzv-backend,--rdzv_backend", backend,
                 "static (fixed nodes and ranks) or c10d (elastic; implied by --nnodes MIN:MAX)")
      ->envname("PET_RDZV_BACKEND")
      ->check(CLI::IsMember({"static", "c10d"}));
  app.add_option("--rdzv-id,--rdzv_id", cfg.elastic.run_id, "the job's id on the rendezvous")
      ->envname("PET_RDZV_ID");
  app.add_option("--rdzv-last-call,--rdzv_last_call", last_call_s,
                 "elastic: once MIN nodes joined, seconds to wait for more")
      ->check(CLI::Range(0.0, 86400.0));
  app.add_option("--rdzv-join-timeout", join_timeout_s,
                 "elastic: seconds a node waits to be admitted to a round")
      ->check(CLI::Range(0.1, 864000.0));
  app.add_option("--rdzv-keep-alive-interval", keep_alive_s, "elastic: seconds between heartbeats")
      ->check(CLI::Range(0.01, 3600.0));
  app.add_option("--rdzv-keep-alive-timeout", keep_alive_timeout_s,
                 "elastic: a node silent this many seconds is taken for dead")
      ->check(CLI::Range(0.05, 86400.0));
  std::string rdzv_conf;
  app.add_option("--rdzv-conf,--rdzv_conf", rdzv_conf,
                 "elastic: torchrun's KEY=VALUE,... with join_timeout, last_call_timeout, "
                 "keep_alive_interval, keep_alive_max_attempt (seconds; the flags above win)")
      ->envname("PET_RDZV_CONF");
  app.add_option("--local-addr,--local_addr", cfg.elastic.local_addr,
                 "elastic: this node's address for the others (default: the interface that "
                 "routes to the rendezvous endpoint)");
  app.add_flag("--standalone", standalone, "single node: local address and a free port");
  app.add_option("--max-restarts,--max_restarts", cfg.max_restarts,
                 "restart the whole group this many times after a failure")
      ->envname("PET_MAX_RESTARTS")
      ->check(CLI::Range(0, 1000000));
  app.add_option("--monitor-interval,--monitor_interval", monitor_interval_s,
                 "seconds between checks of the workers")
      ->check(CLI::Range(0.001, 3600.0));
  app.add_option("--stop-grace", stop_grace_s,
                 "seconds between SIGTERM and SIGKILL when stopping workers")
      ->check(CLI::Range(0.0, 3600.0));
  app.add_option("--log-dir,--log_dir", cfg.log_dir,
                 "write each rank's stdout and stderr to DIR/attempt_<n>/rank_<r>.{stdout,stderr}")
      ->envname("PET_LOG_DIR");
  app.add_option("-r,--redirects", redirects,
                 "these worker streams go to the log files only: 0 none (default), 1 stdout, "
                 "2 stderr, 3 both, or per local rank as 0:1,1:2")
      ->envname("PET_REDIRECTS");
  app.add_option("-t,--tee", tee,
                 "these worker streams go to the log files and the console (same values as "
                 "--redirects)")
      ->envname("PET_TEE");
  app.add_flag("--no-tee", no_tee, "with --log-dir: worker output goes to the files only (-r 3)");
  app.add_option("--local-ranks-filter,--local_ranks_filter", ranks_filter,
                 "only these local ranks' output reaches the console, e.g. 0,1")
      ->envname("PET_LOCAL_RANKS_FILTER");
  app.add_option("--role", cfg.role, "the workers' role (ROLE_NAME)")->envname("PET_ROLE");
  app.add_option("--python", python,
                 "the Python that runs a PROGRAM ending in .py, -m and --run-path (default "
                 "python3)")
      ->envname("TDIST_PYTHON");
  app.add_flag("-m,--module", module, "PROGRAM is a Python module, run as python -m PROGRAM")
      ->envname("PET_MODULE");
  app.add_flag("--no-python,--no_python", no_python,
               "execute PROGRAM as it is, even when it ends in .py")
      ->envname("PET_NO_PYTHON");
  app.add_flag("--run-path,--run_path", run_path,
               "run the Python script PROGRAM with runpy.run_path (takes precedence over "
               "--no-python)")
      ->envname("PET_RUN_PATH");
  std::string cpu_bind = "none";
  app.add_option("--cpu-bind,--cpu_bind", cpu_bind,
                 "none (default), or core: local rank r runs on the r-th CPU this launcher may "
                 "run on (at most that many workers per node)")
      ->check(CLI::IsMember({"none", "core"}));
  // Accepted for torchrun's command lines. torchrun's start method applies to a function
  // entrypoint (multiprocessing); a script's workers are separate processes under both launchers.
  std::string start_method = "spawn";
  app.add_option("--start-method,--start_method", start_method,
                 "torchrun's (spawn, fork, forkserver): accepted; workers are always executed "
                 "as new processes, as torchrun's are for a script")
      ->envname("PET_START_METHOD")
      ->check(CLI::IsMember({"spawn", "fork", "forkserver"}));
  std::string logs_specs;
  app.add_option("--logs-specs,--logs_specs", logs_specs,
                 "torchrun's torchrun.logs_specs entry point: only 'default' (tdist-run writes "
                 "its logs itself: --log-dir, --redirects, --tee)")
      ->envname("PET_LOGS_SPECS");
  app.add_option("--token-file", cfg.token_file,
                 "the job's shared secret (every node has the file; readable by its owner only); "
                 "without one a single-node job makes its own and a multi-node job has none");
  app.add_flag("--insecure", cfg.insecure,
               "let a multi-node job whose store is beyond loopback run without a token (its "
               "store, collective and RPC ports then accept anyone who can reach them); sets "
               "TDIST_ALLOW_NO_TOKEN=1 for the launcher and its workers");
  try {
    app.parse(argc, argv);
    const std::vector<std::string> rest = app.remaining();
    if (rest.empty()) throw CLI::ValidationError("PROGRAM", "no program to launch given");
    if (rest[0].size() > 1 && rest[0][0] == '-') {
      throw CLI::ExtrasError("unknown option " + rest[0], CLI::ExitCodes::ExtrasError);
    }
    cfg.command = worker_command(rest, python, module, no_python, run_path, cfg.entrypoint_name);
    cfg.nproc_per_node = resolve_nproc_per_node(nproc);
    if (!logs_specs.empty() && logs_specs != "default") {
      // torchrun raises ValueError for a name it cannot find (exit 1); tdist-run cannot load a
      // Python LogsSpecs class at all.
      throw TorchrunValueError("--logs-specs '" + logs_specs +
                               "': tdist-run cannot load torchrun.logs_specs plugins; only "
                               "'default' (torchrun's DefaultLogsSpecs) is accepted, whose part "
                               "tdist-run does itself with --log-dir, --redirects and --tee");
    }
    const auto [min_nodes, max_nodes] = parse_nnodes(nnodes);
    cfg.nnodes = max_nodes;
    bool any_port = false;  // torchrun's HOST:0 for a one-node c10d job: a free port
    if (!endpoint.empty()) {
      // HOST alone means torchrun's default port, 29400.
      auto colon = endpoint.rfind(':');
      if (colon == 0)
        throw CLI::ValidationError("--rdzv-endpoint", "'" + endpoint + "' is not HOST:PORT");
      cfg.master_addr = endpoint.substr(0, colon);
      std::string port = colon == std::string::npos ? "29400" : endpoint.substr(colon + 1);
      try {
        size_t used = 0;
        int p = std::stoi(port, &used);
        if (used != port.size() || p < 0 || p > 65535) throw std::out_of_range(port);
        if (p == 0 &&
            (backend != "c10d" || nnodes.find(':') != std::string::npos || max_nodes != 1)) {
          throw std::out_of_range(port);
        }
        cfg.master_port = p;
        any_port = p == 0;
      } catch (const std::exception&) {
        throw CLI::ValidationError("--rdzv-endpoint", "port '" + port +
                                                          "' is not in [1, 65535] (0 only with "
                                                          "--rdzv-backend c10d --nnodes 1)");
      }
    }
    // MIN:MAX (even 2:2) asks for the elastic rendezvous, as --rdzv-backend c10d does; a
    // one-node c10d job on port 0 is a single static node on a free port.
    if (any_port) {
      cfg.elastic.run_id = tdist::random_hex(16);
    } else if (nnodes.find(':') != std::string::npos || backend == "c10d") {
      if (endpoint.empty()) {
        throw CLI::ValidationError("--nnodes", "an elastic job (--nnodes " + nnodes +
                                                   ", --rdzv-backend " + backend +
                                                   ") needs --rdzv-endpoint HOST:PORT");
      }
      if (standalone) throw CLI::ValidationError("--standalone", "is for a single static node");
      cfg.elastic.enabled = true;
      cfg.elastic.min_nodes = min_nodes;
      cfg.elastic.max_nodes = max_nodes;
      cfg.elastic.endpoint_host = cfg.master_addr;
      cfg.elastic.endpoint_port = cfg.master_port;
      apply_rdzv_conf(rdzv_conf, app, last_call_s, join_timeout_s, keep_alive_s,
                      keep_alive_timeout_s);
      cfg.elastic.last_call = seconds(last_call_s);
      cfg.elastic.join_timeout = seconds(join_timeout_s);
      cfg.elastic.keep_alive_interval = seconds(keep_alive_s);
      cfg.elastic.keep_alive_timeout = seconds(keep_alive_timeout_s);
      cfg.node_rank = 0;  // decided per round
    }
    if (standalone) {
      if (cfg.nnodes != 1) throw CLI::ValidationError("--standalone", "needs --nnodes 1");
      cfg.master_addr = "127.0.0.1";
      cfg.master_port = 0;
      cfg.elastic.run_id = tdist::random_hex(16);  // torchrun draws a new id (a uuid4) too
    }
    if (cfg.node_rank >= cfg.nnodes) {
      throw CLI::ValidationError("--node-rank", std::to_string(cfg.node_rank) +
                                                    " is out of range for --nnodes " +
                                                    std::to_string(cfg.nnodes));
    }
    if (no_tee && cfg.log_dir.empty()) throw CLI::ValidationError("--no-tee", "needs --log-dir");
    if (no_tee && (!tee.empty() || !redirects.empty())) {
      throw CLI::ValidationError("--no-tee", "is -r 3; give it or --redirects/--tee, not both");
    }
    try {
      if (!redirects.empty())
        cfg.redirects = tdist::run::parse_stream_choice("--redirects", redirects);
      if (!tee.empty()) cfg.tee = tdist::run::parse_stream_choice("--tee", tee);
    } catch (const tdist::InvalidArgument& e) {
      throw CLI::ValidationError(e.what());
    }
    if (no_tee) cfg.redirects.all = tdist::run::kTeeStdout | tdist::run::kTeeStderr;
    if (!ranks_filter.empty()) cfg.local_ranks_filter = parse_local_ranks(ranks_filter);
    cfg.bind_cores = cpu_bind == "core";
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const TorchrunValueError& e) {
    std::cerr << "tdist-run: " << e.what() << "\n";
    return 1;
  } catch (const CLI::ParseError& e) {
    std::cerr << "tdist-run: " << e.what() << "\nRun with --help for usage.\n";
    return 2;
  }
  cfg.monitor_interval = seconds(monitor_interval_s);
  cfg.stop_grace = seconds(stop_grace_s);
  try {
    tdist::run::Launcher launcher(cfg);
    return launcher.run();
  } catch (const tdist::InvalidArgument& e) {
    std::cerr << "tdist-run: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "tdist-run: " << e.what() << "\n";
    return 1;
  }
}
