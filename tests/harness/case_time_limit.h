#pragma once
// A time limit for each GoogleTest case of a process that runs many (a shard).
//
// Note [Case time limit]
// ctest's TIMEOUT is per entry. One entry per case gives each case its own limit, at the price
// of a process start (loading libtorch, about 0.25 s of CPU) per case; scripts/test.sh instead
// runs the unit tier as a few GoogleTest shards per binary (tests/CMakeLists.txt), and the
// entry's TIMEOUT then bounds the shard, not the case. So that a hang still fails within the
// case's own limit and names the case, a shard's process gets TDIST_TEST_CASE_TIMEOUT (the
// case's limit in seconds) and main() installs a CaseTimeLimit: armed when a case starts and
// disarmed when it ends, it calls its expiry action once a case has run past the limit. The
// default action prints the case and the limit, SIGKILLs the children of every live
// Processes (they would otherwise outlive the shard) and ends the process with exit code 1.
// The entry's own TIMEOUT stays as the backstop for a hang outside any case.

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace testing {
class TestEventListener;
}

namespace tdist::test {

// Thread-safe; arm() and disarm() do not block. The expiry action runs on the watchdog's
// own thread, at most once per arm().
class CaseTimeLimit {
 public:
  using OnExpire = std::function<void(const std::string& name, std::chrono::milliseconds limit)>;

  explicit CaseTimeLimit(std::chrono::milliseconds limit, OnExpire on_expire = default_expiry);
  ~CaseTimeLimit();  // stops and joins the watchdog
  CaseTimeLimit(const CaseTimeLimit&) = delete;
  CaseTimeLimit& operator=(const CaseTimeLimit&) = delete;

  void arm(const std::string& name);  // a case started: its limit runs from now
  void disarm();                      // it ended in time

  // Prints "[  TIMEOUT ] <name> ran past its limit of N s", kills every live Processes's
  // children and exits the process with code 1.
  static void default_expiry(const std::string& name, std::chrono::milliseconds limit);

 private:
  void watch();

  // Constant after construction.
  const std::chrono::milliseconds limit_;
  const OnExpire on_expire_;

  // Guarded by mu_.
  std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false;
  bool stop_ = false;
  std::string name_;
  std::chrono::steady_clock::time_point deadline_;

  std::thread thread_;  // last: starts once the members above exist
};

// The GoogleTest listener that arms `limit` at each case's start and disarms it at its end.
// Does not own `limit`.
std::unique_ptr<::testing::TestEventListener> case_time_limit_listener(CaseTimeLimit& limit);

// TDIST_TEST_CASE_TIMEOUT in seconds (a positive integer); 0 when unset. Throws
// std::invalid_argument naming the variable when it is set to anything else.
int case_timeout_from_env();

}  // namespace tdist::test
