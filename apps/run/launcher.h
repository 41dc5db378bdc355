#pragma once
// The worker launcher behind tdist-run (torchrun's model): spawns `nproc_per_node` copies of a
// program with the rank variables set, relays their output line by line with a rank prefix,
// and fails fast: when one worker fails, the others are stopped (SIGTERM, then SIGKILL after
// `stop_grace`), and the group is restarted while restarts remain.
//
// Not thread safe; run() blocks until the workers are done. SIGINT/SIGTERM/SIGHUP received by the
// launcher during run() are forwarded to every worker.

#include <sys/types.h>

#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace tdist::run {

inline constexpr int kTeeStdout = 1;
inline constexpr int kTeeStderr = 2;

struct LaunchConfig {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // 0: pick a free port on master_addr
  int max_restarts = 0;
  std::chrono::milliseconds monitor_interval{100};
  std::chrono::milliseconds stop_grace{5000};  // between SIGTERM and SIGKILL
  std::string log_dir;  // when set: <log_dir>/attempt_<n>/rank_<r>.{stdout,stderr}
  // Which worker streams are relayed to our stdout/stderr (prefixed): torchrun's --tee values,
  // kTeeStdout | kTeeStderr by default. Without log_dir anything not relayed is dropped.
  int tee = 3;
  std::vector<std::string> command;  // program and its arguments
};

// How a worker ended.
struct WorkerExit {
  int local_rank = -1;
  int rank = -1;
  pid_t pid = -1;
  bool signaled = false;
  int code = 0;  // exit code, or the signal number when signaled
  std::deque<std::string> stderr_tail;  // last lines of its stderr

  bool ok() const { return !signaled && code == 0; }
  std::string describe() const;  // "rank 1 (pid 123) exited with code 3" / "... killed by SIGKILL"
};

class Launcher {
 public:
  static constexpr size_t kStderrTailLines = 20;

  explicit Launcher(LaunchConfig config);
  ~Launcher();

  // Runs the workers to the end (with restarts). Returns the launcher's exit code: 0 when every
  // worker succeeded; 1 when a worker failed and no restart remained (the failure is reported on
  // stderr: first failing rank, exit code or signal, last stderr lines); 128+N when the launcher
  // was stopped by signal N.
  int run();

  // The first failure of the last attempt, if any.
  const std::optional<WorkerExit>& failure() const { return failure_; }
  int restarts_done() const { return restart_count_; }

 private:
  struct Worker;
  enum class Outcome { kSuccess, kFailure, kSignal };

  Outcome run_attempt();
  void spawn(Worker& w);
  // Reads what the workers wrote (waiting up to `wait` for some) and reaps exited workers.
  // Returns false when a forwarded signal arrived.
  bool pump(std::chrono::milliseconds wait);
  void read_stream(Worker& w, int stream);
  void emit_line(Worker& w, int stream, const std::string& line);
  void reap(Worker& w, int status);
  // Sends `sig` to every live worker, waits up to stop_grace for them, then SIGKILLs the rest;
  // drains their output.
  void stop_all(int sig);
  void report_failure(const WorkerExit& e) const;

  LaunchConfig config_;
  int signal_fd_ = -1;
  std::vector<std::unique_ptr<Worker>> workers_;  // of the current attempt
  int restart_count_ = 0;
  int received_signal_ = 0;
  std::optional<WorkerExit> failure_;
};

// Picks a free TCP port on `host` (binds port 0 and releases it).
int pick_free_port(const std::string& host);

}  // namespace tdist::run
