// The RPC fault matrix (real processes): a worker dies by SIGKILL, SIGTERM or abort() (SIGABRT
// sent with kill()) while the two others have work that it serves: calls (rpc_sync and
// rpc_async), an RRef being created (remote() to it, then to_here()), RRefs being deleted (a fork
// it holds of a survivor's RRef, and a survivor's fork of an RRef it owns), a distributed
// backward that crosses it. The survivors must get an error that names the dead worker, from the
// broken connection, within the bound below; then go on talking to each other and shut down
// gracefully.
//
// A worker stopped (SIGSTOP) instead keeps its connections open: nothing tells the survivors,
// so their calls to it end at their timeout (a TimeoutError naming it). Two rows, with a short
// RPC timeout (each costs at least that): calls to a stopped worker that is then resumed
// (SIGCONT; it answers again, the answers to the calls that timed out are dropped, all three shut
// down gracefully), and an RRef being created, RRefs being deleted and a distributed backward
// through a stopped worker that is then killed (SIGKILL, as tdist-run does to a worker that
// ignores its SIGTERM; the survivors go on as in the rows above).
#include <gtest/gtest.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>

#include <cstdio>
#include <iostream>
#include <sstream>

#include "tdist/autograd/context.h"
#include "tdist/core/env.h"
#include "tdist/core/tcp_store.h"
#include "tdist/rpc/api.h"
#include "tests/harness/process.h"
#include "tests/rpc/rpc_test_util.h"

namespace tdist::autograd::test {
namespace {

using namespace std::chrono_literals;
using rpc::RRef;
using rpc::test::Tracked;

constexpr int kVictim = 1;
constexpr Millis kRpcTimeout = 5s;
// The bound on the survivors' error, from the moment a survivor tells the test it is ready (the
// test strikes at once): the RPC timeout plus a slack for a loaded machine. The error must also
// say that the connection was lost: a TimeoutError (a call that waited out kRpcTimeout because
// the broken connection went unnoticed) fails the case even within the bound.
constexpr Millis kBound = kRpcTimeout + 3s;
// The rows with a stopped worker: their calls end only at the RPC timeout, so it is short, with
// the same slack.
constexpr Millis kStopRpcTimeout = 2s;
constexpr Millis kStopBound = kStopRpcTimeout + 3s;

using Clock = std::chrono::steady_clock;

std::shared_ptr<Store> g_store;  // the child's store, for the functions the victim runs

// Tells the test that the victim serves call `tag`, then blocks until the victim is killed or
// the test releases it (a stopped victim that was resumed).
void serve(int64_t tag) {
  g_store->set(str("served/", tag), "1");
  g_store->wait({"release"}, 120s);
}

// x * 2 whose backward tells the test it runs, then blocks: the victim's part of a distributed
// backward, struck while it runs.
struct BlockInBackward : torch::autograd::Function<BlockInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) {
    return x * 2;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    g_store->add("in_backward", 1);
    std::this_thread::sleep_for(120s);
    return {g[0] * 2};
  }
};

void register_fault_functions() {
  rpc::test::register_test_functions();
  rpc::register_function("fm.serve", [](int64_t tag) {
    serve(tag);
    return tag;
  });
  rpc::register_function("fm.blocking_tracked", [](int64_t tag) {
    serve(tag);
    return Tracked(tag);
  });
  rpc::register_function("fm.blocking_stage",
                         [](at::Tensor x) { return BlockInBackward::apply(x); });
  rpc::register_function("fm.triple", [](at::Tensor x) { return x * 3; });
}

// What a survivor's pending work must end with: the lost connection (the victim died), or a
// TimeoutError (the victim was stopped).
enum class Expect { kLost, kTimeout };

// Runs `op`, which must fail because of the victim: the error names it ('p1'), says that the
// connection was lost (kLost; a TimeoutError fails the check) or is a TimeoutError (kTimeout),
// and comes within the bound (kBound, kStopBound) of `t0`. Returns whether it did; prints why not.
bool fails_naming_the_victim(int rank, const std::string& what, Clock::time_point t0,
                             const std::function<void()>& op, Expect expect = Expect::kLost) {
  const Millis bound = expect == Expect::kLost ? kBound : kStopBound;
  try {
    op();
    std::fprintf(stderr, "rank %d: %s did not fail\n", rank, what.c_str());
    return false;
  } catch (const std::exception& e) {
    const auto ms = std::chrono::duration_cast<Millis>(Clock::now() - t0).count();
    const std::string msg = e.what();
    std::fprintf(stderr, "rank %d: %s failed after %lld ms: %s\n", rank, what.c_str(),
                 static_cast<long long>(ms), msg.c_str());
    bool ok = true;
    if (msg.find("'p1'") == std::string::npos) {
      std::fprintf(stderr, "rank %d: FAIL: the error does not name p1\n", rank);
      ok = false;
    }
    const bool timeout = dynamic_cast<const TimeoutError*>(&e) != nullptr;
    if (expect == Expect::kLost && (timeout || msg.find("lost") == std::string::npos)) {
      std::fprintf(stderr, "rank %d: FAIL: the error is not the lost connection\n", rank);
      ok = false;
    }
    if (expect == Expect::kTimeout && !timeout) {
      std::fprintf(stderr, "rank %d: FAIL: the error is not a TimeoutError\n", rank);
      ok = false;
    }
    if (ms > bound.count()) {
      std::fprintf(stderr, "rank %d: FAIL: over the bound of %lld ms\n", rank,
                   static_cast<long long>(bound.count()));
      ok = false;
    }
    return ok;
  }
}

// The victim: reaches the phase, tells the test (ready/1) and waits to be struck. A victim that
// is stopped and then resumed ("cont") goes on: once its blocked calls are released, it serves
// the survivors again and shuts down gracefully with them.
int victim(rpc::RpcAgent& agent, Store& store, const std::string& phase,
           const std::string& after_stop) {
  // No core dump for abort(): writing one delays the close of the sockets by the dump's time.
  ::prctl(PR_SET_DUMPABLE, 0);
  if (phase == "call") {
    store.wait({"served/0", "served/1", "served/20", "served/21"}, 60s);
  } else if (phase == "remote") {
    store.wait({"served/0", "served/20"}, 60s);
  } else if (phase == "delete") {
    // Both worker threads serve a blocked call: the deletion of the fork this worker holds (of
    // p0's RRef) is posted and never sent, and p2's deletion of its fork waits, unanswered.
    store.wait({"served/0", "served/20"}, 60s);
    RRef<Tracked> held;
    {
      std::lock_guard<std::mutex> lock(rpc::test::held_mu());
      auto& m = rpc::test::held_rrefs();
      if (m.size() != 1) return 7;
      held = std::move(m.begin()->second);
      m.clear();
    }
  } else if (phase == "backward") {
    const auto deadline = Clock::now() + 60s;
    while (store.add("in_backward", 0) < 2) {
      if (Clock::now() > deadline) return 8;
      std::this_thread::sleep_for(5ms);
    }
  }
  store.set("ready/1", "1");
  if (after_stop != "cont") {
    std::this_thread::sleep_for(120s);  // struck here
    return 3;
  }
  // Stopped and resumed in here; the test then releases the calls it was serving.
  store.wait({"done/0", "done/2"}, 60s);
  try {
    agent.shutdown(true);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank 1: graceful shutdown failed: %s\n", e.what());
    return 4;
  }
  return 0;
}

// A survivor's part of the phase: sets ready/<rank> (the test strikes once every worker has)
// and checks what it had pending fails naming the victim. Returns 0 when all went as required.
// When the victim was stopped (`stopped`), what it had pending must time out, and the survivor
// then tells the test (timed_out/<rank>) and waits for the victim to be resumed or killed
// ("restruck") before it leaves the phase (a distributed autograd context ends with it, whose
// release goes to the victim too).
int survivor_phase(rpc::RpcAgent& agent, Store& store, const std::string& phase, int rank,
                   bool stopped) {
  const std::string ready = str("ready/", rank);
  const int64_t tag = rank * 10;
  Clock::time_point t0;
  auto go = [&] {
    t0 = Clock::now();
    store.set(ready, "1");
  };
  const Expect expect = stopped ? Expect::kTimeout : Expect::kLost;
  auto after_the_error = [&] {
    if (!stopped) return;
    store.set(str("timed_out/", rank), "1");
    store.wait({"restruck"}, 60s);
  };
  bool ok = true;
  if (phase == "call") {
    auto pending = agent.rpc_async<int64_t>(kVictim, "fm.serve", tag);
    go();
    ok &= fails_naming_the_victim(
        rank, "rpc_sync", t0, [&] { agent.rpc_sync<int64_t>(kVictim, "fm.serve", tag + 1); },
        expect);
    ok &= fails_naming_the_victim(
        rank, "rpc_async", t0, [&] { pending.wait(); }, expect);
    after_the_error();
  } else if (phase == "remote") {
    RRef<Tracked> r = agent.remote<Tracked>(kVictim, "fm.blocking_tracked", tag);
    go();
    ok &= fails_naming_the_victim(
        rank, "to_here", t0, [&] { r.to_here(); }, expect);
    after_the_error();
  } else if (phase == "delete") {
    RRef<Tracked> mine;
    if (rank == 0) {
      // p0 owns an RRef whose only fork the victim holds.
      agent.rpc_sync<void>(kVictim, "hold", rpc::make_rref(agent.shared_from_this(), Tracked(100)),
                           std::string("k"));
    } else {
      // p2 holds a fork of an RRef the victim owns.
      mine = agent.remote<Tracked>(kVictim, "Tracked", int64_t{200});
      if (mine.to_here().id() != 200) return 20;
    }
    auto pending = agent.rpc_async<int64_t>(kVictim, "fm.serve", tag);
    store.wait({"served/0", "served/20"}, 60s);
    if (rank == 2) {
      mine = RRef<Tracked>();  // its deletion goes to the victim, whose threads are all busy
      if (!rpc::test::eventually([&] { return agent.num_pending() == 2; }, 10s)) return 21;
    }
    go();
    ok &= fails_naming_the_victim(
        rank, "rpc_async", t0, [&] { pending.wait(); }, expect);
    after_the_error();  // a stopped victim is killed in here
    // The deletion pending at the dead owner failed with the connection, not at its timeout (at
    // it, when the owner was stopped).
    if (rank == 2 && !rpc::test::eventually([&] { return agent.num_pending() == 0; }, 1s)) {
      std::fprintf(stderr, "rank 2: FAIL: %zu calls still pending\n", agent.num_pending());
      ok = false;
    }
  } else if (phase == "backward") {
    at::Tensor x = torch::randn({2, 3}, torch::kFloat64).requires_grad_(true);
    Context ctx;
    at::Tensor y = agent.rpc_sync<at::Tensor>(kVictim, "fm.blocking_stage", x);
    go();
    ok &= fails_naming_the_victim(
        rank, "backward", t0, [&] { backward(ctx.id(), {y.sum()}); }, expect);
    after_the_error();
  } else {
    return 22;
  }
  return ok ? 0 : 23;
}

// After the strike: calls to the victim fail at once (or, when it was stopped and resumed,
// succeed), the survivors still call each other (a distributed backward too), and shut down
// gracefully.
int survivor_goes_on(rpc::RpcAgent& agent, Store& store, int rank, bool victim_resumed) {
  const int other = rank == 0 ? 2 : 0;
  if (victim_resumed) {
    if (agent.rpc_sync<int64_t>(kVictim, "add", int64_t{rank}, int64_t{2}) != rank + 2) return 35;
  } else {
    try {
      agent.rpc_sync<int64_t>(kVictim, "add", int64_t{1}, int64_t{1});
      return 30;
    } catch (const NetworkError& e) {
      if (std::string(e.what()).find("'p1'") == std::string::npos) return 31;
    }
  }
  if (agent.rpc_sync<int64_t>(other, "add", int64_t{rank}, int64_t{1}) != rank + 1) return 32;
  {
    at::Tensor x = torch::ones({2, 3}, torch::kFloat64).requires_grad_(true);
    Context ctx;
    at::Tensor y = agent.rpc_sync<at::Tensor>(other, "fm.triple", x);
    backward(ctx.id(), {y.sum()});
    if (!torch::equal(get_gradients(ctx.id()).at(x), torch::full({2, 3}, 3.0, torch::kFloat64))) {
      return 33;
    }
  }
  store.set(str("done/", rank), "1");
  store.wait({"done/0", "done/2"}, 60s);
  try {
    agent.shutdown(true);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: graceful shutdown failed: %s\n", rank, e.what());
    return 34;
  }
  for (const auto& leak : agent.leaked_rrefs()) {
    std::fprintf(stderr, "rank %d: leaked at shutdown: %s\n", rank, leak.c_str());
  }
  return 0;
}

TDIST_TEST_CHILD(rpc_fault_child) {
  torch::set_num_threads(1);
  register_fault_functions();
  init();
  const std::string phase = env::get("TDIST_TEST_PHASE").value_or("");
  // "cont" or "kill": the victim is stopped (SIGSTOP), then resumed or killed.
  const std::string after_stop = env::get("TDIST_TEST_AFTER_STOP").value_or("");
  const bool stopped = !after_stop.empty();
  const auto port = static_cast<uint16_t>(env::require_int("MASTER_PORT", 1, 65535));
  auto store = std::make_shared<TCPStore>("127.0.0.1", port, false, 60s);
  g_store = store;
  rpc::RpcOptions o;
  o.store = store;
  o.rpc_timeout = stopped ? kStopRpcTimeout : kRpcTimeout;
  o.shutdown_timeout = 20s;  // a shutdown that waited for the dead worker fails, not hangs
  // In "delete", two threads that both serve a blocked call leave none for RRef messages.
  if (rank == kVictim && phase == "delete") o.num_worker_threads = 2;
  auto agent = rpc::RpcAgent::start("p" + std::to_string(rank), rank, world_size, o);
  rpc::set_current_agent(agent);
  if (rank == kVictim) return victim(*agent, *store, phase, after_stop);
  if (int rc = survivor_phase(*agent, *store, phase, rank, stopped)) return rc;
  const int rc = survivor_goes_on(*agent, *store, rank, after_stop == "cont");
  rpc::set_current_agent(nullptr);
  return rc;
}

struct Fault {
  std::string phase;
  int sig;
  int then = 0;  // after SIGSTOP: SIGCONT or SIGKILL, once the survivors' calls timed out
};

std::string signal_name(int sig) { return std::string("SIG") + ::sigabbrev_np(sig); }

std::ostream& operator<<(std::ostream& os, const Fault& f) {
  os << f.phase << "_" << signal_name(f.sig);
  if (f.then != 0) os << "_then_" << signal_name(f.then);
  return os;
}

// The lines in which a survivor reported its error and how long it took.
std::string reported_errors(const std::string& output) {
  std::istringstream in(output);
  std::string out;
  for (std::string line; std::getline(in, line);) {
    if (line.find(" failed after ") != std::string::npos) out += line + "\n";
  }
  return out;
}

class RpcFault : public ::testing::TestWithParam<Fault> {};

TEST_P(RpcFault, SurvivorsGetAnErrorNamingTheDeadWorkerAndGoOn) {
  const Fault f = GetParam();
  TCPStore server("127.0.0.1", 0, true, 60s);
  const std::string after_stop = f.then == SIGCONT ? "cont" : f.then == SIGKILL ? "kill" : "";
  tdist::test::Processes procs("rpc_fault_child", 3,
                               {{"MASTER_PORT", std::to_string(server.port())},
                                {"TDIST_TEST_PHASE", f.phase},
                                {"TDIST_TEST_AFTER_STOP", after_stop}});
  try {
    server.wait({"ready/0", "ready/1", "ready/2"}, 60s);
  } catch (const TimeoutError&) {
    FAIL() << "the workers did not reach the phase:\n"
           << tdist::test::Processes::failures(procs.wait_all(1s));
  }
  procs.kill(kVictim, f.sig);
  if (f.sig == SIGSTOP) {
    // Once both survivors' calls timed out: resume the victim and release the calls it serves,
    // or kill it (and wait until it is gone: its connections are closed then).
    try {
      server.wait({"timed_out/0", "timed_out/2"}, 60s);
    } catch (const TimeoutError&) {
      procs.kill(kVictim, SIGKILL);
      FAIL() << "the survivors did not report their errors:\n"
             << tdist::test::Processes::failures(procs.wait_all(1s));
    }
    procs.kill(kVictim, f.then);
    if (f.then == SIGKILL) procs.wait(kVictim, 10s);
    server.set("release", "1");
    server.set("restruck", "1");
  }
  auto results = procs.wait_all(60s);
  for (int r : {0, 2}) {
    EXPECT_TRUE(results[r].ok()) << results[r].describe() << "\n" << results[r].output;
    std::cout << reported_errors(results[r].output);
  }
  const int end_signal = f.sig == SIGSTOP ? f.then : f.sig;
  if (end_signal == SIGCONT) {
    EXPECT_TRUE(results[kVictim].ok()) << results[kVictim].describe() << "\n"
                                       << results[kVictim].output;
  } else {
    EXPECT_FALSE(results[kVictim].exited) << results[kVictim].describe() << "\n"
                                          << results[kVictim].output;
    EXPECT_EQ(results[kVictim].signal, end_signal);
  }
  if (f.phase == "delete") {
    // p2's deletion, pending at the victim, is reported naming it (lost with the connection, or
    // timed out when the victim was stopped); p0 keeps the value whose fork the victim held,
    // reported as leaked at shutdown.
    const std::string cause = f.sig == SIGSTOP ? "timed out: no answer from worker 'p1' (rank 1)"
                                               : "connection to worker 'p1' (rank 1) lost";
    std::istringstream lines(results[2].output);
    bool reported = false;
    for (std::string line; std::getline(lines, line);) {
      reported |= line.find("RREF_USER_DELETE") != std::string::npos &&
                  line.find(cause) != std::string::npos;
    }
    EXPECT_TRUE(reported) << "no RREF_USER_DELETE error with '" << cause << "':\n"
                          << results[2].output;
    EXPECT_NE(results[0].output.find("leaked at shutdown: owned RRef"), std::string::npos)
        << results[0].output;
  }
}

std::vector<Fault> faults() {
  std::vector<Fault> out;
  for (const char* phase : {"call", "remote", "delete", "backward"}) {
    for (int sig : {SIGKILL, SIGTERM, SIGABRT}) out.push_back({phase, sig});
  }
  out.push_back({"call", SIGSTOP, SIGCONT});
  for (const char* phase : {"remote", "delete", "backward"})
    out.push_back({phase, SIGSTOP, SIGKILL});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Matrix, RpcFault, ::testing::ValuesIn(faults()), [](const auto& info) {
  std::ostringstream name;
  name << info.param;
  return name.str();
});

}  // namespace
}  // namespace tdist::autograd::test
