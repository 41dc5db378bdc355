#include "tests/rpc/rpc_test_util.h"

#include <sys/resource.h>

#include <exception>
#include <stdexcept>

#include "tdist/core/env.h"

namespace tdist::rpc::test {

std::atomic<int64_t> Tracked::live{0};
std::atomic<int64_t> Tracked::destroyed{0};

std::map<std::string, RRef<Tracked>>& held_rrefs() {
  static std::map<std::string, RRef<Tracked>> m;
  return m;
}
std::mutex& held_mu() {
  static std::mutex mu;
  return mu;
}

namespace {

std::string holder_key(const std::string& key) { return current_agent()->info().name + "/" + key; }

void register_once() {
  register_function("add", [](int64_t a, int64_t b) { return a + b; });
  register_function("concat", [](const std::string& a, const std::string& b) { return a + b; });
  register_function("scale", [](const at::Tensor& t, double s) { return t * s; });
  register_function("echo", [](at::Tensor t) { return t; });
  register_function("echo_tensors", [](std::vector<at::Tensor> v) { return v; });
  register_function("sum", [](const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return s;
  });
  register_function("keys", [](const std::map<std::string, int64_t>& m) {
    std::vector<std::string> k;
    for (const auto& [key, v] : m) k.push_back(key);
    return k;
  });
  register_function("swap", [](std::tuple<int64_t, std::string> t) {
    return std::make_tuple(std::get<1>(t), std::get<0>(t));
  });
  register_function("maybe_double", [](std::optional<int64_t> v) -> std::optional<int64_t> {
    if (!v) return std::nullopt;
    return *v * 2;
  });
  register_function("mirror", [](Point p) { return Point{-p.x, -p.y, p.label + "'"}; });
  register_function(
      "small_types", [](bool b, int8_t i8, uint16_t u16, int32_t i32, uint64_t u64, float f) {
        return std::make_tuple(!b, static_cast<int8_t>(i8 + 1), static_cast<uint16_t>(u16 + 1),
                               i32 + 1, u64 + 1, f * 2);
      });
  register_function("noop", []() {});
  register_function("throws",
                    [](std::string what) -> int64_t { throw std::runtime_error("boom: " + what); });
  register_function("sleep_ms", [](int64_t ms) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return ms;
  });
  register_function("whoami", []() { return current_agent()->info().name; });
  // A calls B's relay, which calls C's add: nested calls through the current agent.
  register_function("relay", [](std::string next, int64_t x) {
    return rpc_sync<int64_t>(next, "add", x, int64_t{1}) * 10;
  });
  register_function("relay_chain", [](std::vector<std::string> chain, int64_t x) -> int64_t {
    if (chain.empty()) return x;
    std::string next = chain.front();
    chain.erase(chain.begin());
    return rpc_sync<int64_t>(next, "relay_chain", chain, x + 1);
  });

  // RRefs as arguments and results.
  register_class<Tracked>("Tracked")
      .constructor<int64_t>()
      .method("id", &Tracked::id)
      .method("add", &Tracked::add);
  register_class<Counter>("Counter")
      .constructor<int64_t>()
      .method("add", &Counter::add)
      .method("get", &Counter::get)
      .method("add_twice", [](Counter& c, int64_t d) {
        c.add(d);
        return c.add(d);
      });
  register_function("make_tracked", [](int64_t id) { return Tracked(id); });
  register_function("rref_id_of", [](RRef<Tracked> r) { return r.rpc_sync<int64_t>("id"); });
  register_function("rref_fetch", [](RRef<Tracked> r) { return r.to_here().id(); });
  register_function("rref_is_owner", [](RRef<Tracked> r) { return r.is_owner(); });
  register_function("local_rref", [](int64_t id) { return make_rref(Tracked(id)); });
  register_function("return_rref", [](RRef<Tracked> r) { return r; });
  register_function("hold", [](RRef<Tracked> r, std::string key) {
    std::lock_guard<std::mutex> lock(held_mu());
    held_rrefs()[holder_key(key)] = r;
  });
  register_function("drop", [](std::string key) {
    RRef<Tracked> r;
    {
      std::lock_guard<std::mutex> lock(held_mu());
      auto it = held_rrefs().find(holder_key(key));
      if (it == held_rrefs().end()) throw std::runtime_error("nothing held as " + key);
      r = std::move(it->second);
      held_rrefs().erase(it);
    }
  });
  register_function("held_id", [](std::string key) {
    RRef<Tracked> r;
    {
      std::lock_guard<std::mutex> lock(held_mu());
      r = held_rrefs().at(holder_key(key));
    }
    return r.to_here().id();
  });
  // Forwards an RRef it received to `next`, which holds it (a fork of a fork).
  register_function("forward_hold", [](RRef<Tracked> r, std::string next, std::string key) {
    rpc_sync<void>(next, "hold", r, key);
  });
  register_function("rref_vector_ids", [](std::vector<RRef<Tracked>> v) {
    std::vector<int64_t> ids;
    for (auto& r : v) ids.push_back(r.rpc_sync<int64_t>("id"));
    return ids;
  });
}

}  // namespace

void register_test_functions() {
  static std::once_flag once;
  std::call_once(once, register_once);
}

Agents start_agents(int n, RpcOptions options) {
  return start_agents(n, [&](int) { return options; });
}

Agents start_agents(int n, const std::function<RpcOptions(int rank)>& options_of) {
  register_test_functions();
  Agents a;
  a.store = std::make_shared<HashStore>(std::chrono::milliseconds(30000));
  a.agents.resize(n);
  std::vector<std::thread> threads;
  std::mutex mu;
  std::exception_ptr first;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      try {
        RpcOptions options = options_of(i);
        options.store = a.store;
        // Raw peers (raw_peer.h) reach the agents at 127.0.0.1; rpc_address_test.cpp tests
        // the address an agent picks by itself.
        if (options.listen_host.empty()) options.listen_host = "127.0.0.1";
        a.agents[i] = RpcAgent::start("w" + std::to_string(i), i, n, options);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
  return a;
}

void shutdown_all(Agents& a, bool graceful) {
  std::vector<std::thread> threads;
  std::mutex mu;
  std::exception_ptr first;
  for (auto& agent : a.agents) {
    threads.emplace_back([&, agent] {
      try {
        agent->shutdown(graceful);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

bool quiet(Agents& a) {
  return eventually([&] {
    for (auto& agent : a.agents) {
      if (!agent->idle() || agent->rref_context().num_pending() != 0) return false;
    }
    return true;
  });
}

uint16_t master_port() { return static_cast<uint16_t>(env::require_int("MASTER_PORT", 1, 65535)); }

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         double(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

}  // namespace tdist::rpc::test
