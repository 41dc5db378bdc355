#include "tests/harness/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "tdist/core/error.h"

namespace tdist::test {
namespace {

std::map<std::string, ChildFn>& registry() {
  static std::map<std::string, ChildFn> r;
  return r;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The pids of every live Processes's children, for kill_all_children().
std::mutex& live_children_mu() {
  static std::mutex mu;
  return mu;
}

std::set<pid_t>& live_children() {
  static std::set<pid_t> pids;
  return pids;
}

}  // namespace

void kill_all_children() {
  std::lock_guard<std::mutex> lock(live_children_mu());
  for (pid_t pid : live_children()) ::kill(pid, SIGKILL);
}

ChildRegistrar::ChildRegistrar(const std::string& name, ChildFn fn) {
  registry()[name] = std::move(fn);
}

int run_child_if_requested() {
  const char* name = std::getenv("TDIST_TEST_CHILD");
  if (name == nullptr) return -1;
  auto it = registry().find(name);
  if (it == registry().end()) {
    std::fprintf(stderr, "unknown test child '%s'\n", name);
    return 127;
  }
  int rank = std::atoi(std::getenv("RANK") ? std::getenv("RANK") : "0");
  int world = std::atoi(std::getenv("WORLD_SIZE") ? std::getenv("WORLD_SIZE") : "1");
  try {
    return it->second(rank, world);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: uncaught exception: %s\n", rank, e.what());
    return 1;
  }
}

std::string ProcessResult::describe() const {
  std::ostringstream os;
  os << "rank " << rank;
  if (exited) {
    os << " exited with code " << exit_code;
  } else {
    os << " killed by signal " << signal << (timed_out ? " (timed out)" : "");
  }
  return os.str();
}

Processes::Processes(const std::string& child, int world_size,
                     const std::map<std::string, std::string>& env) {
  std::string dir = temp_dir("tdist-proc");
  for (int rank = 0; rank < world_size; ++rank) {
    std::string log = dir + "/rank" + std::to_string(rank) + ".log";
    std::map<std::string, std::string> vars = env;
    vars["TDIST_TEST_CHILD"] = child;
    vars["RANK"] = std::to_string(rank);
    vars["WORLD_SIZE"] = std::to_string(world_size);
    if (!vars.count("OMP_NUM_THREADS")) vars["OMP_NUM_THREADS"] = "1";
    pid_t pid = fork();
    TDIST_CHECK(pid >= 0, "fork failed: ", std::strerror(errno));
    if (pid == 0) {
      int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
      }
      for (const auto& [k, v] : vars) setenv(k.c_str(), v.c_str(), 1);
      // Only this test's child body runs; keep GoogleTest out of it.
      char* argv[] = {const_cast<char*>("/proc/self/exe"), nullptr};
      execv("/proc/self/exe", argv);
      _exit(126);
    }
    pids_.push_back(pid);
    logs_.push_back(log);
    std::lock_guard<std::mutex> lock(live_children_mu());
    live_children().insert(pid);
  }
  reaped_.assign(world_size, false);
  results_.resize(world_size);
}

Processes::~Processes() {
  for (size_t r = 0; r < pids_.size(); ++r) {
    if (!reaped_[r]) {
      ::kill(pids_[r], SIGKILL);
      int status = 0;
      waitpid(pids_[r], &status, 0);
      std::lock_guard<std::mutex> lock(live_children_mu());
      live_children().erase(pids_[r]);
    }
  }
}

void Processes::kill(int rank, int sig) { ::kill(pids_.at(rank), sig); }

ProcessResult Processes::reap(int rank, int status, bool timed_out) {
  ProcessResult res;
  res.rank = rank;
  res.timed_out = timed_out;
  if (WIFEXITED(status)) {
    res.exited = true;
    res.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    res.signal = WTERMSIG(status);
  }
  res.output = read_file(logs_[rank]);
  reaped_[rank] = true;
  {
    std::lock_guard<std::mutex> lock(live_children_mu());
    live_children().erase(pids_[rank]);
  }
  results_[rank] = res;
  return res;
}

ProcessResult Processes::wait(int rank, Millis timeout) {
  if (reaped_.at(rank)) return results_[rank];
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    int status = 0;
    pid_t r = waitpid(pids_[rank], &status, WNOHANG);
    if (r == pids_[rank]) return reap(rank, status, false);
    if (std::chrono::steady_clock::now() >= deadline) {
      ::kill(pids_[rank], SIGKILL);
      waitpid(pids_[rank], &status, 0);
      return reap(rank, status, true);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::vector<ProcessResult> Processes::wait_all(Millis timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (size_t r = 0; r < pids_.size(); ++r) {
    auto left = std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
    wait(static_cast<int>(r), std::max(left, Millis(0)));
  }
  return results_;
}

std::string Processes::failures(const std::vector<ProcessResult>& results) {
  std::string out;
  for (const auto& r : results) {
    if (!r.ok()) out += r.describe() + "; its output:\n" + r.output + "\n";
  }
  return out;
}

namespace {

std::mutex& temp_dirs_mu() {
  static std::mutex mu;
  return mu;
}

std::vector<std::string>& temp_dirs() {
  static std::vector<std::string> dirs;
  return dirs;
}

}  // namespace

void remove_temp_dirs() {
  std::lock_guard<std::mutex> lock(temp_dirs_mu());
  for (const auto& d : temp_dirs()) {
    std::error_code ec;  // best effort: a test may have removed it already
    std::filesystem::remove_all(d, ec);
  }
  temp_dirs().clear();
}

std::string temp_dir(const std::string& prefix) {
  std::string tmpl = (std::getenv("TMPDIR") ? std::string(std::getenv("TMPDIR")) : "/tmp") + "/" +
                     prefix + "-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  TDIST_CHECK(mkdtemp(buf.data()) != nullptr, "mkdtemp failed: ", std::strerror(errno));
  std::lock_guard<std::mutex> lock(temp_dirs_mu());
  temp_dirs().push_back(buf.data());
  return buf.data();
}

}  // namespace tdist::test
