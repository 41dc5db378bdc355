#pragma once
// PendingCalls: the agent's outstanding work. It owns
// - the calls this worker sent and awaits an answer to: their ids, their deadlines and the
//   connection each left on. A call is registered (add) before it is sent, so a response can
//   never arrive for an unknown id, and only a response on the connection it left on takes it
//   (take_response). Its completion runs exactly once: with the response, or with the failure:
//   a send or connect that threw (fail_send: InvalidArgument as is, TimeoutError for a send
//   that stalled past the RPC timeout, else NetworkError), the loss of its connection
//   (fail_lost: NetworkError naming the peer, TimeoutError once the call's deadline has
//   passed, as the timeout thread would have said a moment later), its deadline (the timeout thread: TimeoutError
//   naming the peer), or the agent stopping (stop);
// - the timers of RpcAgent::schedule, posted as work when due;
// - the count of work in progress (a completion about to run, an incoming call, posted work),
//   so that idle() (no call pending, nothing in progress) is never true while anything can
//   still send. Whoever takes a call out of the table counts it until its completion ran.
// Its timeout thread sleeps until the earliest deadline or timer. A new deadline or timer wakes
// it only when it comes before the thread's next wake-up (wakes_at_): the deadline of a call
// that completed is not taken out of its sleep, so in a run of calls one after another each
// call's deadline comes after the one the thread sleeps until, and no call pays for waking it
// (a futex wake and a thread switch per call, a fifth of a small call's round trip on two cores).
//
// Locking: mu_ guards everything but the atomics; completions, posts and logging run without it.

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tdist/rpc/detail/connection.h"
#include "tdist/rpc/detail/message.h"
#include "tdist/rpc/detail/response.h"
#include "tdist/rpc/types.h"

namespace tdist::rpc::detail {

class PendingCalls {
 public:
  struct Call {
    ResponseFn on_done;
    std::string what;
    int to = -1;
    Clock::time_point deadline;
    bool has_deadline = false;
    // Complete it on a worker thread even when it could run on the reader thread.
    bool on_pool = false;
    // The connection the request left on: only a response on it completes the call.
    std::weak_ptr<Connection> conn;
  };

  // What take_response found for a response.
  struct Taken {
    std::optional<Call> call;  // the call it answers, now counted in progress
    std::string stray;         // non-empty: nobody asked that connection for it (logged)
  };

  // `self_name` and `peer_name` word the errors; `post` runs a task on the worker pool (false
  // when the pool is stopped).
  PendingCalls(std::string self_name, std::function<std::string(int)> peer_name,
               std::function<bool(std::function<void()>)> post);
  ~PendingCalls();
  PendingCalls(const PendingCalls&) = delete;
  PendingCalls& operator=(const PendingCalls&) = delete;

  // Starts the timeout thread.
  void start();

  // Registers a call to `to` (timeout 0: no deadline) under a fresh id and returns the id; 0
  // when the agent is stopping, after failing the call (its completion has run).
  uint64_t add(int to, Millis timeout, ResponseFn on_done, std::string what, bool on_pool);
  // The connection call `id` left on.
  void set_connection(uint64_t id, const std::shared_ptr<Connection>& conn);
  // Sending call `id` threw `error` (being handled): fails it, unless its connection's close
  // failed it first. The request no longer counts as sent.
  void fail_send(uint64_t id, const std::exception& e, std::exception_ptr error);
  // A response or error with `id` arrived on `conn`.
  Taken take_response(uint64_t id, const Connection& conn);
  // Fails the calls to `rank` that left on a connection now closed (not those still connecting
  // or sent on a newer connection), completing them on the pool.
  void fail_lost(int rank, const std::string& reason);
  // Runs a taken call's completion (never throws) and ends its count in progress.
  void complete(Call& call, Message* msg, std::exception_ptr error);

  // Work in progress: enter() always counts; try_enter() does not once stopping. leave() ends
  // one.
  void enter();
  bool try_enter();
  void leave();
  // Runs fn on the pool, counted in progress until it returns; nothing once stopping.
  void post_work(std::function<void()> fn);
  // Posts fn as work at `when` (or never, when the agent stops first).
  void schedule(Clock::time_point when, std::function<void()> fn);

  bool idle() const;
  bool wait_idle(Clock::time_point deadline);
  size_t size() const;
  // A few pending calls and the count in progress, for a shutdown timeout.
  std::string describe_busy() const;
  // The next id to be handed out: ids below it were sent.
  uint64_t next_id() const { return next_id_.load(); }
  int64_t sent() const { return sent_.load(); }

  // Stops: no more calls or work; fails every pending call with Error("... <reason> before it
  // finished"), drops the timers and wakes the timeout thread.
  void stop(const std::string& reason);
  // Joins the timeout thread (after the pool stopped).
  void join();

 private:
  void timeout_loop();
  // The TimeoutError of a call whose deadline passed without an answer.
  std::exception_ptr timed_out(const Call& call) const;

  // Constant after construction.
  const std::string self_name_;
  const std::function<std::string(int)> peer_name_;
  const std::function<bool(std::function<void()>)> post_;

  std::thread timeout_thread_;
  std::atomic<uint64_t> next_id_{1};
  std::atomic<int64_t> sent_{0};

  mutable std::mutex mu_;
  std::condition_variable idle_cv_;           // calls_ emptied or in_progress_ reached 0
  std::condition_variable timeout_cv_;        // a new earliest deadline or timer, or stopping
  std::unordered_map<uint64_t, Call> calls_;  // guarded by mu_
  std::set<std::pair<Clock::time_point, uint64_t>> deadlines_;      // guarded by mu_
  std::multimap<Clock::time_point, std::function<void()>> timers_;  // guarded by mu_
  // When timeout_loop wakes up next by itself (max: only when notified; min: it is awake).
  Clock::time_point wakes_at_ = Clock::time_point::min();  // guarded by mu_
  int64_t in_progress_ = 0;                                // guarded by mu_
  bool stopping_ = false;                                  // guarded by mu_
};

}  // namespace tdist::rpc::detail
