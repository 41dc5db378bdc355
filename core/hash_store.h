#pragma once
// HashStore: an in-process Store (one map behind a mutex). For threads of one process: tests,
// world size 1, and the thread harness. Thread safe; get/wait block on a condition variable.

#include <condition_variable>
#include <map>
#include <mutex>

#include "tdist/core/store.h"

namespace tdist {

class HashStore : public Store {
 public:
  explicit HashStore(Millis timeout = kDefaultTimeout) : Store(timeout) {}

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  // "127.0.0.1": every user of a HashStore is a thread of this process, so of this host; the
  // groups and RPC agents over it bind loopback (Note [Secure by default], core/token.h).
  std::string server_host() const override { return "127.0.0.1"; }
  using Store::set;
  using Store::wait;

 private:
  // Blocks (holding `lock`) until all keys exist; throws TimeoutError naming the missing ones.
  void wait_locked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                   Millis timeout);

  std::mutex mu_;
  std::condition_variable cv_;         // notified on every change
  std::map<std::string, Bytes> data_;  // guarded by mu_
};

}  // namespace tdist
