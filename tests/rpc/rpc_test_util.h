#pragma once
// Helpers shared by the RPC tests: agents as threads of this process over one HashStore, and the
// functions and classes the tests call (registered once per process).

#include <torch/torch.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tdist/core/hash_store.h"
#include "tdist/rpc/api.h"

namespace tdist::rpc::test {

using namespace std::chrono_literals;

// A user struct sent by value (cereal serialize).
struct Point {
  double x = 0;
  double y = 0;
  std::string label;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(x, y, label);
  }
  bool operator==(const Point& o) const { return x == o.x && y == o.y && label == o.label; }
};

// A class that lives behind RRefs. Counts the instances that a constructor call created (moves
// pass that on; copies and default-constructed decode targets do not count), per process.
class Tracked {
 public:
  static std::atomic<int64_t> live;
  static std::atomic<int64_t> destroyed;
  explicit Tracked(int64_t id) : id_(id), counted_(true) { ++live; }
  Tracked() = default;
  Tracked(const Tracked& o) : id_(o.id_) {}
  Tracked(Tracked&& o) noexcept : id_(o.id_), counted_(o.counted_) { o.counted_ = false; }
  Tracked& operator=(const Tracked& o) {
    id_ = o.id_;
    return *this;
  }
  ~Tracked() {
    if (counted_) {
      --live;
      ++destroyed;
    }
  }
  int64_t id() const { return id_; }
  int64_t add(int64_t d) { return id_ += d; }
  template <class Archive>
  void serialize(Archive& ar) {
    ar(id_);
  }

 private:
  int64_t id_ = 0;
  bool counted_ = false;
};

// A class without serialization: usable through RRefs only.
class Counter {
 public:
  explicit Counter(int64_t start) : value_(start) {}
  int64_t add(int64_t d) {
    std::lock_guard<std::mutex> lock(mu_);
    return value_ += d;
  }
  int64_t get() const {
    std::lock_guard<std::mutex> lock(mu_);
    return value_;
  }

 private:
  mutable std::mutex mu_;
  int64_t value_;
};

void register_test_functions();

struct Agents {
  std::shared_ptr<HashStore> store;
  std::vector<std::shared_ptr<RpcAgent>> agents;
  std::shared_ptr<RpcAgent>& operator[](size_t i) { return agents[i]; }
  size_t size() const { return agents.size(); }
};

// Starts n agents named w0..w{n-1} (each start() on its own thread, as they wait for each
// other), with `options` (its store is replaced by a fresh HashStore; an empty listen_host by
// 127.0.0.1).
Agents start_agents(int n, RpcOptions options = {});
// The same with options per rank (their stores are replaced by one fresh HashStore).
Agents start_agents(int n, const std::function<RpcOptions(int rank)>& options_of);
// Shuts all down concurrently; rethrows the first error.
void shutdown_all(Agents& a, bool graceful = true);

// Waits (polling, bounded) until pred() holds; false when `timeout` passes first.
template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout = 20s) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

// Whether no call and no RRef message is in flight on any agent (eventually, within its bound).
bool quiet(Agents& a);

// A child process's MASTER_PORT (tdist::test::spawn_processes sets it).
uint16_t master_port();

// RRefs kept by the test functions "hold" / "drop", keyed by "<worker>/<key>".
std::map<std::string, RRef<Tracked>>& held_rrefs();
std::mutex& held_mu();

// User and system CPU seconds this process has used so far.
double cpu_seconds();

}  // namespace tdist::rpc::test
