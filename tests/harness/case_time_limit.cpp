#include "tests/harness/case_time_limit.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "tests/harness/process.h"

namespace tdist::test {

CaseTimeLimit::CaseTimeLimit(std::chrono::milliseconds limit, OnExpire on_expire)
    : limit_(limit), on_expire_(std::move(on_expire)), thread_([this] { watch(); }) {}

CaseTimeLimit::~CaseTimeLimit() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void CaseTimeLimit::arm(const std::string& name) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = true;
    name_ = name;
    deadline_ = std::chrono::steady_clock::now() + limit_;
  }
  cv_.notify_all();
}

void CaseTimeLimit::disarm() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = false;
  }
  cv_.notify_all();
}

void CaseTimeLimit::watch() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (!armed_) {
      cv_.wait(lock);
      continue;
    }
    // arm() may move the deadline while this waits: only an armed case past the deadline
    // read after waking has expired.
    cv_.wait_until(lock, deadline_);
    if (!stop_ && armed_ && std::chrono::steady_clock::now() >= deadline_) {
      armed_ = false;
      const std::string name = name_;
      lock.unlock();
      on_expire_(name, limit_);
      lock.lock();
    }
  }
}

void CaseTimeLimit::default_expiry(const std::string& name, std::chrono::milliseconds limit) {
  std::fprintf(stderr,
               "[  TIMEOUT ] %s ran past its limit of %lld s (TDIST_TEST_CASE_TIMEOUT); the "
               "cases after it in this process did not run\n",
               name.c_str(), static_cast<long long>(limit.count() / 1000));
  std::fflush(stdout);
  std::fflush(stderr);
  kill_all_children();
  std::_Exit(1);
}

namespace {

class Listener : public ::testing::EmptyTestEventListener {
 public:
  explicit Listener(CaseTimeLimit& limit) : limit_(limit) {}
  void OnTestStart(const ::testing::TestInfo& info) override {
    limit_.arm(std::string(info.test_suite_name()) + "." + info.name());
  }
  void OnTestEnd(const ::testing::TestInfo&) override { limit_.disarm(); }

 private:
  CaseTimeLimit& limit_;
};

}  // namespace

std::unique_ptr<::testing::TestEventListener> case_time_limit_listener(CaseTimeLimit& limit) {
  return std::make_unique<Listener>(limit);
}

int case_timeout_from_env() {
  const char* value = std::getenv("TDIST_TEST_CASE_TIMEOUT");
  if (value == nullptr || *value == '\0') return 0;
  char* end = nullptr;
  const long seconds = std::strtol(value, &end, 10);
  if (*end != '\0' || seconds <= 0 || seconds > 86400) {
    throw std::invalid_argument(std::string("TDIST_TEST_CASE_TIMEOUT must be a whole number of ") +
                                "seconds from 1 to 86400, not '" + value + "'");
  }
  return static_cast<int>(seconds);
}

}  // namespace tdist::test
