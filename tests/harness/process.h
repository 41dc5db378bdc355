#pragma once
// Process harness: runs ranks as real processes, for crash, signal and timeout tests.
//
// A test binary registers child bodies by name:
//
//   TDIST_TEST_CHILD(allreduce_child) {   // int(int rank, int world_size)
//     ... return 0;                       // the process exit code
//   }
//
// and a test starts them with Processes("allreduce_child", 4, {{"MASTER_PORT", "1234"}}).
// Children are the same test binary re-executed (fork + exec of /proc/self/exe, so no state of
// the parent leaks into them) with TDIST_TEST_CHILD, RANK and WORLD_SIZE set; the harness's
// main() dispatches them before GoogleTest starts. Each child's stdout and stderr go to one file
// that the result carries. Children are always reaped: wait_all() kills the rest (SIGKILL) when
// its timeout passes, and the destructor kills and reaps whatever still runs.

#include <sys/types.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tdist/core/store.h"

namespace tdist::test {

using ChildFn = std::function<int(int rank, int world_size)>;

struct ChildRegistrar {
  ChildRegistrar(const std::string& name, ChildFn fn);
};

#define TDIST_TEST_CHILD(name)                                               \
  static int name##_body(int rank, int world_size);                          \
  static ::tdist::test::ChildRegistrar name##_registrar(#name, name##_body); \
  static int name##_body([[maybe_unused]] int rank, [[maybe_unused]] int world_size)

// Called first thing in main(): when this process is a child, runs its body and returns its exit
// code; otherwise returns -1.
int run_child_if_requested();

struct ProcessResult {
  int rank = -1;
  bool exited = false;  // exited normally with exit_code
  int exit_code = -1;
  int signal = 0;          // the signal that ended it, when !exited
  bool timed_out = false;  // killed by wait_all's timeout
  std::string output;      // stdout + stderr

  bool ok() const { return exited && exit_code == 0; }
  std::string describe() const;  // "rank 1 exited with code 3" / "rank 0 killed by signal 9"
};

class Processes {
 public:
  Processes(const std::string& child, int world_size,
            const std::map<std::string, std::string>& env = {});
  ~Processes();
  Processes(const Processes&) = delete;
  Processes& operator=(const Processes&) = delete;

  pid_t pid(int rank) const { return pids_.at(rank); }
  void kill(int rank, int sig);
  // Waits for one rank (up to timeout; then SIGKILL). Result for that rank.
  ProcessResult wait(int rank, Millis timeout);
  // Waits for every rank until `timeout` in total, kills the ones still running, and returns
  // one result per rank.
  std::vector<ProcessResult> wait_all(Millis timeout);

  // Asserts (via gtest) that every rank exited 0; prints each failure's output otherwise.
  static std::string failures(const std::vector<ProcessResult>& results);

 private:
  ProcessResult reap(int rank, int status, bool timed_out);

  std::vector<pid_t> pids_;
  std::vector<std::string> logs_;
  std::vector<bool> reaped_;
  std::vector<ProcessResult> results_;
};

// SIGKILLs the children of every live Processes (they are reaped by their destructors, or by
// init once this process is gone): the last act of a case that ran past its time limit
// (Note [Case time limit] in tests/harness/case_time_limit.h).
void kill_all_children();

// A fresh temporary directory. The test binary's main() removes every directory made this way
// when the tests are done (remove_temp_dirs).
std::string temp_dir(const std::string& prefix = "tdist-test");
void remove_temp_dirs();

}  // namespace tdist::test
