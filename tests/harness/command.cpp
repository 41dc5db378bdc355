#include "tests/harness/command.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "tdist/core/error.h"
#include "tests/harness/process.h"

namespace tdist::test {
namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::string CommandResult::describe() const {
  std::ostringstream os;
  if (timed_out) os << "timed out; ";
  if (exited) {
    os << "exit code " << exit_code;
  } else {
    os << "signal " << signal;
  }
  os << "\n--- stdout ---\n" << out << "\n--- stderr ---\n" << err;
  return os.str();
}

CommandResult run_command(const std::vector<std::string>& argv, const CommandOptions& opts) {
  TDIST_CHECK(!argv.empty(), "empty command");
  std::string dir = temp_dir("tdist-cmd");
  std::string out_path = dir + "/stdout", err_path = dir + "/stderr";
  pid_t pid = fork();
  TDIST_CHECK(pid >= 0, "fork: ", std::strerror(errno));
  if (pid == 0) {
    setpgid(0, 0);  // its own process group, so a timeout kills everything it started
    int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int in = ::open("/dev/null", O_RDONLY);
    dup2(in, 0);
    dup2(out, 1);
    dup2(err, 2);
    for (const auto& [k, v] : opts.env) setenv(k.c_str(), v.c_str(), 1);
    if (!opts.cwd.empty() && chdir(opts.cwd.c_str()) != 0) _exit(126);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    std::fprintf(stderr, "cannot execute %s: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);
  if (opts.on_start) opts.on_start(pid);
  CommandResult res;
  const auto deadline = std::chrono::steady_clock::now() + opts.timeout;
  int status = 0;
  for (;;) {
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      res.timed_out = true;
      ::kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // Whatever the command left behind in its process group goes too.
  ::kill(-pid, SIGKILL);
  if (WIFEXITED(status)) {
    res.exited = true;
    res.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    res.signal = WTERMSIG(status);
  }
  res.out = slurp(out_path);
  res.err = slurp(err_path);
  return res;
}

}  // namespace tdist::test
