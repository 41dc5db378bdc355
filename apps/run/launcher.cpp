#include "apps/run/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>

#include "apps/run/error_file.h"

#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/net/address.h"
#include "tdist/core/token.h"

namespace tdist::run {
namespace {

using Clock = std::chrono::steady_clock;

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const int saved = errno;
  unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &b, 1);
  errno = saved;
}

// In a forked worker before exec: writes `what`, errno's text and a newline to stderr (with write
// alone: the launcher may run threads) and exits 127.
[[noreturn]] void child_fail(const std::string& what, int err) {
  const char* why = std::strerror(err);
  [[maybe_unused]] ssize_t n1 = ::write(STDERR_FILENO, what.data(), what.size());
  [[maybe_unused]] ssize_t n2 = ::write(STDERR_FILENO, why, std::strlen(why));
  [[maybe_unused]] ssize_t n3 = ::write(STDERR_FILENO, "\n", 1);
  _exit(127);
}

// Installs the forwarding handlers for the lifetime of one run().
class SignalForwarding {
 public:
  // torchrun's default --signals-to-handle (TORCHELASTIC_SIGNALS_TO_HANDLE below).
  static constexpr int kSignals[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT};

  SignalForwarding() {
    TDIST_CHECK(::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) == 0,
                "pipe2: ", std::strerror(errno));
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < std::size(kSignals); ++i) sigaction(kSignals[i], &sa, &old_[i]);
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &ign, &old_pipe_);
  }
  ~SignalForwarding() {
    for (size_t i = 0; i < std::size(kSignals); ++i) sigaction(kSignals[i], &old_[i], nullptr);
    sigaction(SIGPIPE, &old_pipe_, nullptr);
    ::close(g_signal_pipe[0]);
    ::close(g_signal_pipe[1]);
    g_signal_pipe[0] = g_signal_pipe[1] = -1;
  }
  int fd() const { return g_signal_pipe[0]; }

 private:
  struct sigaction old_[std::size(kSignals)]{};
  struct sigaction old_pipe_ {};
};

// The last signal written to the self-pipe `fd`, or 0.
int take_signal(int fd) {
  unsigned char b = 0;
  int sig = 0;
  while (::read(fd, &b, 1) == 1) sig = b;
  return sig;
}

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the reader went away; output is best effort
    off += static_cast<size_t>(n);
  }
}

}  // namespace

struct Launcher::Worker {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;
  bool exited = false;
  WorkerExit exit;
  // Index 0: stdout, 1: stderr.
  int fd[2] = {-1, -1};
  std::string partial[2];
  int log_fd[2] = {-1, -1};
  int console = kTeeStdout | kTeeStderr;  // the streams relayed to the console
  bool stopped = false;  // stopped by the launcher (its exit is not a failure of its own)

  bool streams_open() const { return fd[0] >= 0 || fd[1] >= 0; }

  ~Worker() {
    for (int i = 0; i < 2; ++i) {
      if (fd[i] >= 0) ::close(fd[i]);
      if (log_fd[i] >= 0) ::close(log_fd[i]);
    }
  }
};

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

std::string WorkerExit::describe() const {
  std::string s = str("rank ", rank, " (local rank ", local_rank, ", pid ", pid, ")");
  if (signaled) return s + " was killed by " + signal_name(code);
  return s + " exited with code " + std::to_string(code);
}

int StreamChoice::for_local_rank(int local_rank) const {
  if (per_rank.empty()) return all;
  auto it = per_rank.find(local_rank);
  return it == per_rank.end() ? 0 : it->second;
}

StreamChoice parse_stream_choice(const std::string& flag, const std::string& text) {
  auto streams = [&](const std::string& t) {
    TDIST_CHECK_ARG(t.size() == 1 && t[0] >= '0' && t[0] <= '3', flag, " '", text,
                    "' is not 0-3 (1 stdout, 2 stderr, 3 both) or LOCAL_RANK:0-3,...");
    return t[0] - '0';
  };
  StreamChoice c;
  if (text.find(':') == std::string::npos) {
    c.all = streams(text);
    return c;
  }
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    const std::string item = text.substr(pos, comma - pos);
    const auto colon = item.find(':');
    TDIST_CHECK_ARG(colon != std::string::npos, flag, " '", text, "': '", item,
                    "' is not LOCAL_RANK:0-3");
    const int lr = static_cast<int>(env::parse_int(flag, item.substr(0, colon), 0, 65535));
    c.per_rank[lr] = streams(item.substr(colon + 1));
    pos = comma + 1;
  }
  return c;
}

Launcher::~Launcher() {
  workers_.clear();  // closes their log files first
  if (!scratch_dir_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(scratch_dir_, ignored);
  }
}

Launcher::Launcher(LaunchConfig config) : config_(std::move(config)) {
  TDIST_CHECK_ARG(!config_.command.empty(), "no program to launch");
  TDIST_CHECK_ARG(config_.nproc_per_node >= 1, "--nproc-per-node must be at least 1, got ",
                  config_.nproc_per_node);
  TDIST_CHECK_ARG(config_.nnodes >= 1, "--nnodes must be at least 1, got ", config_.nnodes);
  TDIST_CHECK_ARG(config_.node_rank >= 0 && config_.node_rank < config_.nnodes, "--node-rank ",
                  config_.node_rank, " is out of range for --nnodes ", config_.nnodes);
  TDIST_CHECK_ARG(config_.master_port >= 0 && config_.master_port <= 65535, "--master-port ",
                  config_.master_port, " is not in [0, 65535]");
  TDIST_CHECK_ARG(config_.max_restarts >= 0, "--max-restarts must be >= 0");
  if (config_.bind_cores) {
    cpus_ = env::allowed_cpus();
    TDIST_CHECK_ARG(config_.nproc_per_node <= static_cast<int>(cpus_.size()),
                    "--cpu-bind core: ", config_.nproc_per_node,
                    " workers per node, but the launcher may run on only ", cpus_.size(),
                    " CPUs (use --cpu-bind none)");
  }
}

// Note [Binding workers to cores]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With --cpu-bind core each worker is started on one CPU of its own: local rank r gets the r-th
// CPU of the launcher's affinity mask, set in the child before it execs (so its threads inherit
// it), as Open MPI's --bind-to core does. Workers then never share a core while another idles,
// and they do not migrate away from their caches. It is opt-in, as torchrun's binding is: a bound
// worker's intra-op threads all share its one core, which suits one thread per rank (what
// tdist-run sets with several workers per node) and not a rank that wants several. More workers
// per node than CPUs is refused rather than doubled up.

// Note [Launcher token]
// ~~~~~~~~~~~~~~~~~~~~~
// Every port of a job (the store, each worker's collective mesh and RPC port) authenticates its
// peers with the job's token (core/net/handshake.h), read from TDIST_TOKEN or TDIST_TOKEN_FILE.
// The launcher decides it once, before its own stores or any worker start, and leaves it in its
// environment, which the workers inherit:
//   --token-file PATH  checked now (core/token.h: a regular file, no group/other access) and
//                      passed on as TDIST_TOKEN_FILE, so the secret itself is in no environment;
//   TDIST_TOKEN or TDIST_TOKEN_FILE already set: used as it is;
//   neither, one static node: 32 random bytes (getrandom), hex, as TDIST_TOKEN: every local job
//                      is authenticated with no set-up, and each run has its own token (marked
//                      TDIST_TOKEN_DRAWN=1: tdist-train keys no checkpoint with it);
//   neither, several nodes or elastic, the store on loopback: no token (each node would draw
//                      its own; every node is this host), one warning;
//   neither, several nodes or elastic, the store beyond loopback: refused (InvalidArgument
//                      naming --token-file and --insecure), unless --insecure or
//                      TDIST_ALLOW_NO_TOKEN=1: then TDIST_ALLOW_NO_TOKEN=1 for the launcher and
//                      its workers (whose stores and ports would refuse otherwise) and one
//                      warning that names the ports that anyone who reaches them can use.
void Launcher::prepare_token() {
  if (!config_.token_file.empty()) {
    TDIST_CHECK_ARG(!env::get("TDIST_TOKEN") && !env::get("TDIST_TOKEN_FILE"), "--token-file ",
                    config_.token_file,
                    " and TDIST_TOKEN / TDIST_TOKEN_FILE "
                    "are both given; give only one");
    try {
      (void)read_token_file(config_.token_file);  // its problems are reported now, by name
    } catch (const InvalidArgument& e) {
      TDIST_THROW(InvalidArgument, "--token-file: ", e.what());
    }
    ::setenv("TDIST_TOKEN_FILE", config_.token_file.c_str(), 1);
    return;
  }
  if (!load_token().value.empty()) return;
  if (!config_.elastic.enabled && config_.nnodes == 1) {
    ::setenv("TDIST_TOKEN", random_hex(32).c_str(), 1);
    // This run's alone: checkpoints are not keyed with it (Note [Checkpoint key] in
    // apps/train/checkpoint.h), or no later run could resume them.
    ::setenv("TDIST_TOKEN_DRAWN", "1", 1);
    return;
  }
  const std::string& store_host =
      config_.elastic.enabled ? config_.elastic.endpoint_host : config_.master_addr;
  const std::string store =
      config_.elastic.enabled
          ? net::host_port(config_.elastic.endpoint_host, config_.elastic.endpoint_port)
          : net::host_port(config_.master_addr, config_.master_port);
  if (!net::is_loopback_host(store_host)) {
    const bool allowed = config_.insecure || env::get_bool("TDIST_ALLOW_NO_TOKEN", false);
    TDIST_CHECK_ARG(allowed, "this multi-node job has no token, and its store at ", store,
                    " and every worker's ports would accept anyone who can reach them: give "
                    "--token-file (the same secret file on every node) or set TDIST_TOKEN_FILE, "
                    "or run it without a token with --insecure");
    ::setenv("TDIST_ALLOW_NO_TOKEN", "1", 1);
  }
  std::fprintf(stderr,
               "tdist-run: warning: this multi-node job has no token (--token-file, or "
               "TDIST_TOKEN_FILE on every node): the store at %s and every worker's collective "
               "and RPC ports accept anyone who can reach them\n",
               store.c_str());
}

namespace {

// A new directory "<$TMPDIR or /tmp>/tdist-run-XXXXXX".
std::string make_temp_dir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/tdist-run-XXXXXX";
  TDIST_CHECK(::mkdtemp(pattern.data()) != nullptr, "cannot make a directory ", pattern, ": ",
              std::strerror(errno));
  return pattern;
}

}  // namespace

int Launcher::run() {
  prepare_token();
  if (config_.log_dir.empty()) {
    if (config_.redirects.any() || config_.tee.any()) {
      // torchrun's way: redirected or teed streams need files, so there is a directory.
      config_.log_dir = make_temp_dir();
      std::fprintf(stderr, "tdist-run: log directory: %s\n", config_.log_dir.c_str());
    } else {
      scratch_dir_ = make_temp_dir();
    }
  }
  SignalForwarding signals;
  signal_fd_ = signals.fd();
  return config_.elastic.enabled ? run_elastic() : run_static();
}

int Launcher::run_static() {
  if (config_.master_port == 0) config_.master_port = pick_free_port(config_.master_addr);
  for (;;) {
    Outcome outcome = run_attempt();
    if (outcome == Outcome::kSuccess) return 0;
    if (outcome == Outcome::kSignal) {
      std::fprintf(stderr, "tdist-run: stopped by %s; workers stopped\n",
                   signal_name(received_signal_).c_str());
      return kStoppedBySignalExit;
    }
    if (restart_count_ < config_.max_restarts) {
      ++restart_count_;
      std::fprintf(stderr, "tdist-run: %s; restarting all workers (restart %d of %d)\n",
                   failure_->describe().c_str(), restart_count_, config_.max_restarts);
      continue;
    }
    report_failure(*failure_);
    return 1;
  }
}

Launcher::Outcome Launcher::run_attempt() {
  Assignment a;
  a.node_rank = config_.node_rank;
  a.nnodes = config_.nnodes;
  a.master_addr = config_.master_addr;
  a.master_port = config_.master_port;
  a.attempt = restart_count_;
  start_workers(a);
  Outcome outcome = watch_workers({});
  if (outcome == Outcome::kFailure) stop_all(SIGTERM);
  if (outcome == Outcome::kSuccess && !drain_exited()) outcome = Outcome::kSignal;
  return outcome;
}

void Launcher::start_workers(const Assignment& a) {
  failure_.reset();
  workers_.clear();
  for (int lr = 0; lr < config_.nproc_per_node; ++lr) {
    auto w = std::make_unique<Worker>();
    w->local_rank = lr;
    w->rank = a.node_rank * config_.nproc_per_node + lr;
    w->exit.local_rank = lr;
    w->exit.rank = w->rank;
    workers_.push_back(std::move(w));
  }
  for (auto& w : workers_) spawn(*w, a);
}

Launcher::Outcome Launcher::watch_workers(const std::function<bool()>& tick) {
  auto all_exited = [&] {
    for (auto& w : workers_)
      if (!w->exited) return false;
    return true;
  };
  while (!all_exited()) {
    if (!pump(config_.monitor_interval)) {
      stop_all(received_signal_);
      return Outcome::kSignal;
    }
    for (auto& w : workers_) {
      if (w->exited && !w->exit.ok() && !failure_) {
        failure_ = w->exit;
        return Outcome::kFailure;
      }
    }
    if (tick && tick()) return Outcome::kInterrupted;
  }
  return Outcome::kSuccess;
}

std::string Launcher::attempt_dir(int64_t attempt) {
  const std::string& base = config_.log_dir.empty() ? scratch_dir_ : config_.log_dir;
  const std::string dir = base + "/attempt_" + std::to_string(attempt);
  // The logs hold what workers print: group-readable at most. The base may be a link the user
  // made; the attempt's directory must be a directory of ours, not something planted there.
  if (::mkdir(base.c_str(), 0750) != 0 && errno != EEXIST) {
    TDIST_THROW(Error, "cannot create the log directory ", base, ": ", std::strerror(errno));
  }
  if (::mkdir(dir.c_str(), 0750) != 0 && errno != EEXIST) {
    TDIST_THROW(Error, "cannot create the log directory ", dir, ": ", std::strerror(errno));
  }
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) {
    TDIST_THROW(Error, "refusing the log directory ", dir,
                ": it is not a directory of this user (a link or another user's directory was "
                "there first)");
  }
  return dir;
}

bool Launcher::drain_exited() {
  // Everyone exited: drain what is left in the pipes (bounded, in case a grandchild keeps one
  // open).
  const auto drain_until = Clock::now() + std::chrono::seconds(2);
  auto open = [&] {
    for (auto& w : workers_)
      if (w->streams_open()) return true;
    return false;
  };
  while (open() && Clock::now() < drain_until) {
    if (!pump(std::chrono::milliseconds(50))) return false;
  }
  return true;
}

bool Launcher::signal_pending() {
  if (received_signal_ == 0) received_signal_ = take_signal(signal_fd_);
  return received_signal_ != 0;
}

void Launcher::spawn(Worker& w, const Assignment& a) {
  int pipes[2][2];
  for (auto& p : pipes) {
    TDIST_CHECK(::pipe2(p, O_CLOEXEC) == 0, "pipe2: ", std::strerror(errno));
  }
  const std::string dir = attempt_dir(a.attempt);
  // Note [Worker error files]: a path of its own that does not exist yet.
  w.exit.error_file = dir + "/rank_" + std::to_string(w.rank) + ".error.json";
  ::unlink(w.exit.error_file.c_str());
  const int redirected = config_.redirects.for_local_rank(w.local_rank);
  w.console = ((~redirected & 3) | config_.tee.for_local_rank(w.local_rank));
  const auto& filter = config_.local_ranks_filter;
  if (!filter.empty() && std::find(filter.begin(), filter.end(), w.local_rank) == filter.end()) {
    w.console = 0;
  }
  if (!config_.log_dir.empty()) {
    const char* names[2] = {"stdout", "stderr"};
    for (int i = 0; i < 2; ++i) {
      std::string path = dir + "/rank_" + std::to_string(w.rank) + "." + names[i];
      // Never through a link planted at the name (O_NOFOLLOW); group-readable at most.
      w.log_fd[i] =
          ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0640);
      TDIST_CHECK(w.log_fd[i] >= 0, "cannot open log file ", path, ": ", std::strerror(errno));
    }
  }
  const int world = a.nnodes * config_.nproc_per_node;
  std::vector<std::pair<std::string, std::string>> vars = {
      {"RANK", std::to_string(w.rank)},
      {"LOCAL_RANK", std::to_string(w.local_rank)},
      {"WORLD_SIZE", std::to_string(world)},
      {"LOCAL_WORLD_SIZE", std::to_string(config_.nproc_per_node)},
      {"GROUP_RANK", std::to_string(a.node_rank)},
      {"GROUP_WORLD_SIZE", std::to_string(a.nnodes)},
      {"MASTER_ADDR", a.master_addr},
      {"MASTER_PORT", std::to_string(a.master_port)},
      {"TDIST_RESTART_COUNT", std::to_string(a.attempt)},
      {"TDIST_MAX_RESTARTS", std::to_string(config_.max_restarts)},
      // torchrun's variables (its LocalElasticAgent): one role, so role ranks are ranks.
      {"ROLE_RANK", std::to_string(w.rank)},
      {"ROLE_NAME", config_.role},
      {"ROLE_WORLD_SIZE", std::to_string(world)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count_)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(config_.max_restarts)},
      {"TORCHELASTIC_RUN_ID", config_.elastic.run_id},
      // torchrun hosts the workers' store itself and says so with True; under tdist-run rank 0
      // hosts it at MASTER_ADDR:MASTER_PORT, as torch.distributed's env:// does with False.
      {"TORCHELASTIC_USE_AGENT_STORE", "False"},
      {"TORCHELASTIC_ERROR_FILE", w.exit.error_file},
      {"TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"},
  };
  const char* nccl_async = std::getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING");
  vars.emplace_back("TORCH_NCCL_ASYNC_ERROR_HANDLING", nccl_async ? nccl_async : "1");
  // Several workers on one node share its cores: one intra-op thread each unless told.
  if (config_.nproc_per_node > 1 && !std::getenv("OMP_NUM_THREADS")) {
    vars.emplace_back("OMP_NUM_THREADS", "1");
  }
  // The environment is built before fork: the launcher may run store threads, and a child of a
  // threaded process may only call async-signal-safe functions until it execs.
  std::vector<std::string> env_text;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    bool overridden = false;
    for (const auto& [k, v] : vars) overridden = overridden || k == name;
    if (!overridden) env_text.push_back(std::move(entry));
  }
  for (const auto& [k, v] : vars) env_text.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& e : env_text) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<char*> argv;
  for (auto& arg : config_.command) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  const std::string cannot_exec = "tdist-run: cannot execute '" + config_.command[0] + "': ";
  const std::string cannot_bind = "tdist-run: --cpu-bind core: cannot bind local rank " +
                                  std::to_string(w.local_rank) + " to its CPU: ";
  cpu_set_t cpu;
  CPU_ZERO(&cpu);
  if (config_.bind_cores) CPU_SET(cpus_.at(static_cast<size_t>(w.local_rank)), &cpu);
  const pid_t launcher_pid = ::getpid();
  pid_t pid = ::fork();
  TDIST_CHECK(pid >= 0, "fork: ", std::strerror(errno));
  if (pid == 0) {
    ::dup2(pipes[0][1], STDOUT_FILENO);
    ::dup2(pipes[1][1], STDERR_FILENO);
    // A worker does not outlive its launcher (a node that dies takes its workers with it).
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != launcher_pid) _exit(127);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    signal(SIGPIPE, SIG_DFL);
    if (config_.bind_cores && ::sched_setaffinity(0, sizeof(cpu), &cpu) != 0) {
      child_fail(cannot_bind, errno);
    }
    ::execvpe(argv[0], argv.data(), envp.data());
    child_fail(cannot_exec, errno);
  }
  w.pid = pid;
  w.exit.pid = pid;
  for (int i = 0; i < 2; ++i) {
    ::close(pipes[i][1]);
    w.fd[i] = pipes[i][0];
    ::fcntl(w.fd[i], F_SETFL, ::fcntl(w.fd[i], F_GETFL) | O_NONBLOCK);
  }
}

bool Launcher::pump(std::chrono::milliseconds wait) {
  std::vector<pollfd> fds;
  std::vector<std::pair<Worker*, int>> owners;
  fds.push_back({signal_fd_, POLLIN, 0});
  owners.push_back({nullptr, -1});
  for (auto& w : workers_) {
    for (int i = 0; i < 2; ++i) {
      if (w->fd[i] >= 0) {
        fds.push_back({w->fd[i], POLLIN, 0});
        owners.push_back({w.get(), i});
      }
    }
  }
  int n = ::poll(fds.data(), fds.size(), static_cast<int>(wait.count()));
  if (n > 0) {
    if (fds[0].revents & POLLIN) {
      int sig = take_signal(signal_fd_);
      if (sig != 0) {
        received_signal_ = sig;
        return false;
      }
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR))
        read_stream(*owners[i].first, owners[i].second);
    }
  }
  for (auto& w : workers_) {
    if (w->exited) continue;
    int status = 0;
    if (::waitpid(w->pid, &status, WNOHANG) == w->pid) reap(*w, status);
  }
  return true;
}

void Launcher::read_stream(Worker& w, int stream) {
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(w.fd[stream], buf, sizeof(buf));
    if (n > 0) {
      std::string& part = w.partial[stream];
      part.append(buf, static_cast<size_t>(n));
      size_t start = 0;
      for (size_t nl; (nl = part.find('\n', start)) != std::string::npos; start = nl + 1) {
        for (; nl - start > kMaxLineBytes; start += kMaxLineBytes) {
          emit_line(w, stream, part.substr(start, kMaxLineBytes));
        }
        emit_line(w, stream, part.substr(start, nl - start));
      }
      for (; part.size() - start > kMaxLineBytes; start += kMaxLineBytes) {
        emit_line(w, stream, part.substr(start, kMaxLineBytes));
      }
      part.erase(0, start);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    // EOF or error: flush the unterminated last line and close.
    if (!w.partial[stream].empty()) {
      emit_line(w, stream, w.partial[stream]);
      w.partial[stream].clear();
    }
    ::close(w.fd[stream]);
    w.fd[stream] = -1;
    return;
  }
}

void Launcher::emit_line(Worker& w, int stream, const std::string& line) {
  if (w.log_fd[stream] >= 0) write_all(w.log_fd[stream], line + "\n");
  if (stream == 1) {
    w.exit.stderr_tail.push_back(line);
    if (w.exit.stderr_tail.size() > kStderrTailLines) w.exit.stderr_tail.pop_front();
  }
  if (w.console & (stream == 0 ? kTeeStdout : kTeeStderr)) {
    write_all(stream == 0 ? STDOUT_FILENO : STDERR_FILENO,
              "[rank " + std::to_string(w.rank) + "] " + line + "\n");
  }
}

void Launcher::reap(Worker& w, int status) {
  w.exited = true;
  if (WIFSIGNALED(status)) {
    w.exit.signaled = true;
    w.exit.code = WTERMSIG(status);
  } else {
    w.exit.code = WEXITSTATUS(status);
  }
}

void Launcher::stop_all(int sig) {
  for (auto& w : workers_) {
    if (w->exited) continue;
    w->stopped = true;
    ::kill(w->pid, sig);
  }
  const auto deadline = Clock::now() + config_.stop_grace;
  auto live = [&] {
    for (auto& w : workers_)
      if (!w->exited) return true;
    return false;
  };
  while (live() && Clock::now() < deadline) {
    if (!pump(std::chrono::milliseconds(20))) {
      // A second signal while stopping: stop waiting politely.
      break;
    }
  }
  for (auto& w : workers_) {
    if (w->exited) continue;
    ::kill(w->pid, SIGKILL);
    int status = 0;
    ::waitpid(w->pid, &status, 0);
    reap(*w, status);
  }
  // Drain what the workers wrote before they died (bounded: a grandchild may hold a pipe).
  const auto drain_until = Clock::now() + std::chrono::milliseconds(500);
  auto open = [&] {
    for (auto& w : workers_)
      if (w->streams_open()) return true;
    return false;
  };
  while (open() && Clock::now() < drain_until) pump(std::chrono::milliseconds(20));
  // Fold in the failed worker's last output, drained just now.
  for (auto& w : workers_) {
    if (failure_ && w->rank == failure_->rank) failure_->stderr_tail = w->exit.stderr_tail;
  }
}

void Launcher::report_failure(const WorkerExit& e) const {
  std::string msg = "tdist-run: worker failed: " + e.describe();
  if (config_.max_restarts > 0) {
    msg += str(" (after ", restart_count_, " of ", config_.max_restarts, " restarts)");
  }
  msg += "\n";
  // torchrun's report (Note [Worker error files]): every worker that failed on its own.
  std::vector<ProcessFailure> failures;
  for (const auto& w : workers_) {
    if (!w->exited || w->exit.ok() || w->stopped) continue;
    const WorkerExit& x = w->exit;
    failures.push_back(read_process_failure(x.rank, x.local_rank, x.pid,
                                            x.signaled ? -x.code : x.code, x.error_file));
  }
  // The failure seen first leads, so that it is the root cause when timestamps tie.
  std::stable_partition(failures.begin(), failures.end(),
                        [&](const ProcessFailure& f) { return f.rank == e.rank; });
  if (failures.empty() || failures.front().rank != e.rank) {
    failures.insert(failures.begin(),
                    read_process_failure(e.rank, e.local_rank, e.pid, e.signaled ? -e.code : e.code,
                                         e.error_file));
  }
  // A worker that recorded its exception has its traceback in the report; for one that did
  // not, its last stderr lines say what happened.
  const bool recorded = failures.front().error_file == e.error_file;
  if (!recorded && !e.stderr_tail.empty()) {
    msg += str("tdist-run: last ", e.stderr_tail.size(), " lines of rank ", e.rank, "'s stderr:\n");
    for (const auto& line : e.stderr_tail) msg += "  " + line + "\n";
  }
  const std::string name =
      config_.entrypoint_name.empty() ? config_.command[0] : config_.entrypoint_name;
  msg += format_child_failed(name, failures);
  write_all(STDERR_FILENO, msg);
}

int pick_free_port(const std::string& host) { return net::Listener(host, 0, 1).port(); }

}  // namespace tdist::run
