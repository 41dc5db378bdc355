#pragma once
// Store: the small key-value service that ranks use to find each other (addresses, counters,
// barriers). Mirrors c10d::Store.
//
// Contract (every implementation):
//   set(key, value)           overwrites; wakes every waiter on `key`.
//   get(key)                  blocks until `key` exists or timeout() passes (TimeoutError naming
//                             the key and the seconds), then returns its value.
//   add(key, delta)           atomically adds to the integer stored as decimal text (0 if
//                             missing) and returns the new value; `get` then returns the text.
//   compare_set(key, expected, desired)
//                             if the key is missing and `expected` is empty, or its value equals
//                             `expected`, stores `desired` and returns it; otherwise returns the
//                             current value (or `expected` when the key is missing).
//   wait(keys[, timeout])     blocks until every key exists; TimeoutError lists the missing keys.
//   check(keys)               true when every key exists; never blocks.
//   delete_key(key)           true when the key existed.
//   num_keys()                number of keys.
// Thread safety: all methods may be called concurrently from any thread.
// Timeouts: a timeout of zero (kNoTimeout) means wait forever.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace tdist {

using Bytes = std::vector<uint8_t>;
using Millis = std::chrono::milliseconds;

Bytes to_bytes(std::string_view s);
std::string to_string(const Bytes& b);

class Store {
 public:
  static constexpr Millis kDefaultTimeout{300000};  // c10d's default: 5 minutes
  static constexpr Millis kNoTimeout{0};

  explicit Store(Millis timeout = kDefaultTimeout) : timeout_ms_(timeout.count()) {}
  virtual ~Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  virtual void set(const std::string& key, const Bytes& value) = 0;
  virtual Bytes get(const std::string& key) = 0;
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  virtual Bytes compare_set(const std::string& key, const Bytes& expected,
                            const Bytes& desired) = 0;
  virtual void wait(const std::vector<std::string>& keys, Millis timeout) = 0;
  virtual bool check(const std::vector<std::string>& keys) = 0;
  virtual bool delete_key(const std::string& key) = 0;
  virtual int64_t num_keys() = 0;

  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }

  // String conveniences.
  void set(const std::string& key, std::string_view value) { set(key, to_bytes(value)); }
  void set(const std::string& key, const char* value) { set(key, to_bytes(value)); }
  std::string get_string(const std::string& key) { return to_string(get(key)); }

  // The host name or address this store's server is reached at (a TCPStore, or a store that
  // wraps one); "127.0.0.1" for a HashStore (its users are threads of this process); empty when
  // the store has no network server and may be shared between hosts (FileStore). A process
  // group publishes the address of the interface that routes to it (core/net/address.h).
  virtual std::string server_host() const { return {}; }

  Millis timeout() const { return Millis(timeout_ms_.load()); }
  void set_timeout(Millis timeout) { timeout_ms_.store(timeout.count()); }

 private:
  // Atomic so that set_timeout may race with blocking calls on other threads.
  std::atomic<Millis::rep> timeout_ms_;
};

}  // namespace tdist
