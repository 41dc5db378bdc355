#pragma once
// Runs a command (fork/exec, no shell) to completion with a timeout, capturing its stdout and
// stderr; kills it (SIGKILL) and its process group when the timeout passes. Used to test the
// binaries (tdist-run, tdist-train) and the Python interop as a user runs them.

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace tdist::test {

struct CommandResult {
  bool exited = false;
  int exit_code = -1;
  int signal = 0;
  bool timed_out = false;
  std::string out;
  std::string err;
  std::string describe() const;  // exit status and both streams, for assertion messages
};

struct CommandOptions {
  std::chrono::milliseconds timeout{60000};
  std::map<std::string, std::string> env;  // added to (overriding) the current environment
  std::string cwd;
  // Called with the child's pid once it started (e.g. to send it a signal later).
  std::function<void(pid_t)> on_start;
};

CommandResult run_command(const std::vector<std::string>& argv, const CommandOptions& opts = {});

// Options that stop the command after `seconds`, with `env` added to its environment.
inline CommandOptions with_timeout(int seconds, std::map<std::string, std::string> env = {}) {
  CommandOptions o;
  o.timeout = std::chrono::seconds(seconds);
  o.env = std::move(env);
  return o;
}

}  // namespace tdist::test
