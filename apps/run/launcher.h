#pragma once
// The worker launcher behind tdist-run (torchrun's model): spawns `nproc_per_node` copies of a
// program with the rank variables set, relays their output line by line with a rank prefix,
// and fails fast: when one worker fails, the others are stopped (SIGTERM, then SIGKILL after
// `stop_grace`), and the group is restarted while restarts remain.
//
// The job's token (Note [Launcher token] in launcher.cpp): a single-node job gets a fresh random
// one unless the user gave one; a multi-node job takes --token-file (or the user's
// TDIST_TOKEN / TDIST_TOKEN_FILE) and runs without one after a warning otherwise.
//
// Not thread safe; run() blocks until the workers are done. SIGTERM, SIGINT, SIGHUP and SIGQUIT
// (torchrun's default set) received by the launcher during run() are forwarded to every worker.

#include <sys/types.h>

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace tdist::run {

inline constexpr int kTeeStdout = 1;
inline constexpr int kTeeStderr = 2;

// torchrun's --redirects / --tee value: a set of streams (kTeeStdout | kTeeStderr) for every
// local rank ("3"), or one per local rank ("0:1,1:2"; a local rank not named gets none).
struct StreamChoice {
  int all = 0;
  std::map<int, int> per_rank;  // when not empty, `all` is not used

  int for_local_rank(int local_rank) const;
  bool any() const { return all != 0 || !per_rank.empty(); }
};

// Parses a StreamChoice; throws InvalidArgument naming `flag` on anything else.
StreamChoice parse_stream_choice(const std::string& flag, const std::string& text);

// Elastic mode (--nnodes MIN:MAX with --rdzv-endpoint): Note [Elastic rendezvous] in
// rendezvous.cpp. nnodes/node_rank/master_* of LaunchConfig are then decided per round.
struct ElasticOptions {
  bool enabled = false;
  int min_nodes = 1;
  int max_nodes = 1;
  std::string endpoint_host;
  int endpoint_port = 0;
  std::string run_id = "none";
  std::string local_addr;  // empty: the address of the interface that routes to the endpoint
  std::chrono::milliseconds last_call{2000};
  std::chrono::milliseconds join_timeout{600000};
  std::chrono::milliseconds keep_alive_interval{1000};
  std::chrono::milliseconds keep_alive_timeout{10000};
};

struct LaunchConfig {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // 0: pick a free port on master_addr
  int max_restarts = 0;
  std::chrono::milliseconds monitor_interval{100};
  std::chrono::milliseconds stop_grace{5000};  // between SIGTERM and SIGKILL
  // When set: <log_dir>/attempt_<n>/rank_<r>.{stdout,stderr} and rank_<r>.error.json. When
  // not set but redirects or tee are: a new directory under $TMPDIR (named on stderr), as
  // torchrun makes one.
  std::string log_dir;
  // torchrun's --redirects and --tee: a local rank's redirected streams reach only its log file;
  // the console gets what is not redirected, plus what is teed (each line prefixed with the
  // rank). With log_dir every stream is also written to its file.
  StreamChoice redirects;
  StreamChoice tee;
  // torchrun's --local-ranks-filter: only these local ranks' output reaches the console (their
  // log files are written all the same). Empty: every local rank's.
  std::vector<int> local_ranks_filter;
  std::vector<std::string> command;  // program and its arguments
  // What the failure report calls the job ("<name> FAILED"), torchrun's entrypoint name: the
  // script or module of a Python worker, the program otherwise. Empty: command[0].
  std::string entrypoint_name;
  std::string role = "default";  // torchrun's --role: the workers' ROLE_NAME
  ElasticOptions elastic;
  // --token-file: the job's shared secret, a file every node has (core/token.h's rules).
  std::string token_file;
  // --insecure: a multi-node job beyond loopback may run without a token (Note [Launcher token]).
  bool insecure = false;
  // --cpu-bind core: local rank r runs on the r-th CPU the launcher may run on (Note [Binding
  // workers to cores]); more workers per node than such CPUs is refused.
  bool bind_cores = false;
};

// How a worker ended.
struct WorkerExit {
  int local_rank = -1;
  int rank = -1;
  pid_t pid = -1;
  bool signaled = false;
  int code = 0;                         // exit code, or the signal number when signaled
  std::deque<std::string> stderr_tail;  // last lines of its stderr
  std::string error_file;               // its TORCHELASTIC_ERROR_FILE (Note [Worker error files])

  bool ok() const { return !signaled && code == 0; }
  std::string describe() const;  // "rank 1 (pid 123) exited with code 3" / "... killed by SIGKILL"
};

class Launcher {
 public:
  static constexpr size_t kStderrTailLines = 20;
  // A worker's line longer than this is passed on in pieces of this size, each a line of its
  // own: what the launcher holds per stream stays bounded whatever a worker writes.
  static constexpr size_t kMaxLineBytes = 64 * 1024;

  explicit Launcher(LaunchConfig config);
  ~Launcher();

  // Runs the workers to the end (with restarts). Returns the launcher's exit code: 0 when every
  // worker succeeded; 1 when a worker failed and no restart remained (the failure is reported on
  // stderr: first failing rank, exit code or signal, last stderr lines); kStoppedBySignalExit
  // when the launcher was stopped by a signal (forwarded to the workers).
  int run();

  // torchrun's exit code when a signal stops it: its agent raises SignalException, which ends
  // the Python process with 1. Schedulers that read 128+N from the launcher do not get it from
  // torchrun either; the signal is named on stderr.
  static constexpr int kStoppedBySignalExit = 1;

  // The first failure of the last attempt, if any.
  const std::optional<WorkerExit>& failure() const { return failure_; }
  int restarts_done() const { return restart_count_; }

 private:
  struct Worker;
  // kInterrupted: the watcher's tick asked to stop watching (the workers still run).
  enum class Outcome { kSuccess, kFailure, kSignal, kInterrupted };
  // Where this node's workers sit in one attempt (static) or round (elastic).
  struct Assignment {
    int node_rank = 0;
    int nnodes = 1;
    std::string master_addr;
    int master_port = 0;
    int64_t attempt = 0;  // TDIST_RESTART_COUNT and the log directory's attempt_<n>
  };

  // Decides the job's token before anything starts and puts it where the launcher's own
  // stores and every worker read it (the environment).
  void prepare_token();
  int run_static();
  int run_elastic();  // launcher_elastic.cpp
  Outcome run_attempt();
  void start_workers(const Assignment& a);
  // Relays output and reaps workers until they all succeeded, one failed (failure_ is set; the
  // others still run), a signal arrived, or `tick` (called every monitor interval, may be
  // empty) returned true.
  Outcome watch_workers(const std::function<bool()>& tick);
  // Drains what is left in the workers' pipes after they all exited (bounded).
  bool drain_exited();
  // Reads a pending forwarded signal into received_signal_; true when one arrived.
  bool signal_pending();
  void spawn(Worker& w, const Assignment& a);
  // Reads what the workers wrote (waiting up to `wait` for some) and reaps exited workers.
  // Returns false when a forwarded signal arrived.
  bool pump(std::chrono::milliseconds wait);
  // The directory of one attempt's log and error files (made if missing).
  std::string attempt_dir(int64_t attempt);
  void read_stream(Worker& w, int stream);
  void emit_line(Worker& w, int stream, const std::string& line);
  void reap(Worker& w, int status);
  // Sends `sig` to every live worker (marking it stopped: not a failure of its own), waits up to
  // stop_grace for them, then SIGKILLs the rest; drains their output.
  void stop_all(int sig);
  void report_failure(const WorkerExit& e) const;

  LaunchConfig config_;
  std::vector<int> cpus_;  // with bind_cores: the CPUs the launcher may run on, in order
  // Without log_dir: the directory of the workers' error files, removed with the launcher.
  std::string scratch_dir_;
  int signal_fd_ = -1;
  std::vector<std::unique_ptr<Worker>> workers_;  // of the current attempt
  int restart_count_ = 0;
  int received_signal_ = 0;
  std::optional<WorkerExit> failure_;
};

// "SIGTERM", or "signal N" for one without a name.
std::string signal_name(int sig);

// Picks a free TCP port on `host` (binds port 0 and releases it).
int pick_free_port(const std::string& host);

}  // namespace tdist::run
