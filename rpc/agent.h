#pragma once
// RpcAgent: one worker of an RPC group. Listens on a TCP port, connects to the other workers on
// first use, runs incoming calls on a pool of worker threads, and matches responses to the
// futures of outgoing calls.
//
//   auto agent = RpcAgent::start("trainer", 0, 2, options);   // blocks until all have joined
//   int64_t s = agent->rpc_sync<int64_t>("ps", "add", int64_t{1}, int64_t{2});
//   Future<at::Tensor> f = agent->rpc_async<at::Tensor>(1, "scale", t, 2.0);
//   RRef<Counter> c = agent->remote<Counter>("ps", "Counter", int64_t{0});
//   agent->shutdown();
//
// Most programs use the free functions in rpc/api.h (init_rpc, rpc_sync, ...), which call the
// process's current agent; tests run several agents in one process (one per thread).
//
// Calls: the caller encodes the arguments with their static types (signature.h); the callee
// refuses a name it has not registered, or a signature that differs, with an error that reaches
// the caller's future as a RemoteError naming the worker. Every call has a timeout (the
// per-call Timeout, else RpcOptions::rpc_timeout; 0 means none) after which its future fails
// with TimeoutError; a connection that breaks (a worker died) fails every call pending on it at
// once with NetworkError.
//
// Note [RPC graceful shutdown]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// shutdown(true) returns once no call and no RRef message is in flight anywhere, so that every
// worker can stop without failing another. Each worker counts the requests it has sent and
// received. In rounds r = 0, 1, ... through the store, each worker first waits until it is
// locally idle (no call of its own pending, no incoming call running), then publishes
// (sent, received) for round r and reads everybody's round r. It stops when in two consecutive
// rounds every worker published the same counts. Why that suffices: a worker that was idle when
// it published round r-1 and has neither sent nor received a request by the time it publishes
// round r stayed idle in between (only a request sent or received makes it busy). Each worker
// publishes round r only after reading all of round r-1, so these quiet intervals share an
// instant at which every worker was idle; and an idle worker has no request of its own in
// flight and no answer of its own to give, so at that instant nothing was in flight anywhere.
// Otherwise (work was still moving) it goes on with the next round. Every wait is bounded by
// RpcOptions::shutdown_timeout; on timeout the agent still stops and shutdown() throws.
// A worker that died does not hold the others up: each worker records the peers whose
// established connection broke while it ran (a killed process's sockets close at once), and
// while it waits for a round it marks them gone in the store; a round's wait then stops waiting
// for a gone worker. A gone worker's keys were all set before any worker saw its connection
// break, so once its gone mark is visible, whether its key for a round exists is settled, and
// every worker reads the same round (a gone worker without a key counts as (-1, -1)). A worker
// that nobody was connected to is not noticed and is waited for until the timeout; a worker
// declared gone while still alive (its connection broke) fails its own shutdown with an Error.
// From round 1 on (every worker has entered shutdown), each round starts by deleting the user
// RRefs this worker still holds (a RREF_USER_DELETE each, as PyTorch's shutdown does; the
// handles stay valid objects but name nothing any more) and by dropping the owned RRefs that
// were never shared; a deletion sent is a request, so the rounds go on until it is answered.
// RRefs still registered after the last round are leaks (e.g. a fork whose registration
// failed, which is never released, see Note [RRef protocol]): they are logged and kept in
// leaked_rrefs().
// shutdown(true) from one of the agent's own worker threads is refused (InvalidArgument): it
// would wait for the very call that runs it.
//
// Thread safety: every method may be called from any thread. Ownership: start() returns the
// only owning reference handed out; the agent's threads stop in shutdown() (or the destructor,
// which shuts down without waiting for the others).

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tdist/core/serialize.h"
#include "tdist/rpc/detail/agent_parts.h"
#include "tdist/rpc/detail/call_codec.h"
#include "tdist/rpc/detail/connection.h"
#include "tdist/rpc/detail/message.h"
#include "tdist/rpc/detail/rref_context.h"
#include "tdist/rpc/errors.h"
#include "tdist/rpc/future.h"
#include "tdist/rpc/registry.h"
#include "tdist/rpc/types.h"

namespace tdist::rpc {

template <class T>
class RRef;

class RpcAgent : public std::enable_shared_from_this<RpcAgent>, private detail::ConnectionHandler {
 public:
  // Starts a worker: meets the others' store, listens (RpcOptions::listen_host, else the address
  // net::local_address picks toward the store's host), publishes its address and name in the
  // store, and waits (up to
  // rpc_timeout, or the store's timeout when that is 0) until all world_size workers have.
  // InvalidArgument for a bad rank, an empty or duplicate name.
  static std::shared_ptr<RpcAgent> start(const std::string& name, int rank, int world_size,
                                         RpcOptions options);
  ~RpcAgent() override;
  RpcAgent(const RpcAgent&) = delete;
  RpcAgent& operator=(const RpcAgent&) = delete;

  const WorkerInfo& info() const { return self_; }
  int rank() const { return self_.rank; }
  int world_size() const;
  const RpcOptions& options() const { return options_; }
  // InvalidArgument for an unknown name or a rank out of range.
  const WorkerInfo& worker_info(const To& to) const;
  const std::vector<WorkerInfo>& workers() const;
  // The address this worker listens on and published to the others.
  const std::string& host() const { return host_; }
  uint16_t port() const;

  // Calls (see rpc/api.h for the free-function forms).
  template <class R, class... A>
  Future<R> rpc_async(const To& to, const std::string& fn, Timeout timeout, A&&... args);
  template <class R, class... A>
  Future<R> rpc_async(const To& to, const std::string& fn, A&&... args) {
    return rpc_async<R>(to, fn, Timeout{}, std::forward<A>(args)...);
  }
  template <class R, class... A>
  R rpc_sync(const To& to, const std::string& fn, Timeout timeout, A&&... args) {
    auto f = rpc_async<R>(to, fn, timeout, std::forward<A>(args)...);
    if constexpr (std::is_void_v<R>) {
      f.wait();
    } else {
      return f.value();
    }
  }
  template <class R, class... A>
  R rpc_sync(const To& to, const std::string& fn, A&&... args) {
    return rpc_sync<R>(to, fn, Timeout{}, std::forward<A>(args)...);
  }
  // Defined in rref.h.
  template <class T, class... A>
  RRef<T> remote(const To& to, const std::string& fn, Timeout timeout, A&&... args);
  template <class T, class... A>
  RRef<T> remote(const To& to, const std::string& fn, A&&... args) {
    return remote<T>(to, fn, Timeout{}, std::forward<A>(args)...);
  }

  // See Note [RPC graceful shutdown]. graceful=false closes every connection now and fails
  // whatever is pending. Idempotent. InvalidArgument for graceful=true on a worker thread of
  // this agent.
  void shutdown(bool graceful = true);
  bool is_shut_down() const { return stopped_.load(); }
  // RRefs still registered when shutdown finished (Note [RRef protocol]).
  std::vector<std::string> leaked_rrefs() const;

  // Internals used by RRef<T> and the templates above.
  detail::RRefContext& rref_context() { return *rrefs_; }
  std::shared_ptr<detail::RRefContext> rref_context_ptr() { return rrefs_; }
  detail::Executor* executor();
  int resolve(const To& to) const { return worker_info(to).rank; }
  Millis call_timeout(Timeout t) const {
    return t.value.count() >= 0 ? t.value : options_.rpc_timeout;
  }
  // Sends a request; `on_done` runs exactly once, with the response or the failure (never
  // throws). `on_pool`: run it on a worker thread even when it could run on the reader thread
  // (it may send, or destroy RRefs). `what` describes the call for error messages.
  void send_request(int to, detail::OutMessage&& m, Millis timeout, detail::ResponseFn on_done,
                    std::string what, bool on_pool = false);
  // Runs fn on a worker thread; until it returns the agent is not idle (graceful shutdown
  // waits for it). Nothing runs once the agent is stopping.
  void post_work(std::function<void()> fn);
  // Runs fn on a worker thread at `when` (or never, when the agent stops first).
  void schedule(Clock::time_point when, std::function<void()> fn);
  // Requests sent and received so far, and whether the agent is idle (for tests and shutdown).
  int64_t requests_sent() const;
  int64_t requests_received() const;
  size_t num_pending() const;
  // No call pending, no incoming call running and no posted work (post_work) left.
  bool idle() const;

 private:
  // The agent is composed of parts, each with its own contract and lock (rpc/detail/):
  // Membership (the store, the directory of workers, the shutdown rounds), ConnectionTable
  // (listener, connections, failed peers), PendingCalls (outgoing calls, deadlines, timers, work
  // in progress), Dispatcher (incoming frames, the worker pool), RequestHandler (the answers to
  // incoming requests). The agent wires them together and orders start and stop (agent.cpp).
  RpcAgent(const std::string& name, int rank, int world_size, RpcOptions options);
  // Stops every part: fails what is pending, closes every connection, joins every thread.
  void stop_everything(const std::string& reason);
  std::string peer_name(int rank) const;
  // Runs a task on the pool, the agent kept alive until it ends (detail::Dispatcher::post).
  bool post_to_pool(std::function<void()> task);

  // ConnectionHandler (reader threads).
  void on_message(const std::shared_ptr<detail::Connection>& conn, detail::Message&& msg) override;
  void on_closed(const std::shared_ptr<detail::Connection>& conn,
                 const std::string& reason) override;
  std::string on_authenticated(const std::shared_ptr<detail::Connection>& conn) override;

  // Constant after start().
  WorkerInfo self_;
  RpcOptions options_;
  std::string host_;
  std::string token_source_;  // where options_.token came from (for the log)
  std::shared_ptr<detail::RRefContext> rrefs_;
  // The parts, made in start() and stopped by stop_everything(); each locks itself.
  std::unique_ptr<detail::Membership> members_;
  std::unique_ptr<detail::PendingCalls> pending_;
  std::unique_ptr<detail::RequestHandler> handler_;  // outlives the dispatcher, which calls it
  std::unique_ptr<detail::Dispatcher> dispatcher_;
  std::unique_ptr<detail::ConnectionTable> connections_;

  std::atomic<bool> stopped_{false};
  std::mutex shutdown_mu_;  // serializes shutdown()
  mutable std::mutex leaks_mu_;
  std::vector<std::string> leaked_;  // guarded by leaks_mu_
};

template <class R, class... A>
Future<R> RpcAgent::rpc_async(const To& to, const std::string& fn, Timeout timeout, A&&... args) {
  const int dest = resolve(to);
  const Signature& sig = signature_of<R, wire_t<A>...>();
  Future<R> fut;
  detail::OutMessage m = detail::encode_message(detail::MessageType::kCall, rrefs_.get(), dest,
                                                std::make_tuple(detail::CallHeader{fn, sig.hash}),
                                                wire_arg(std::forward<A>(args))...);
  std::string what = str("rpc '", fn, "' as ", sig.text, " to worker '", workers()[dest].name, "'");
  fut.set_description(what);
  send_request(dest, std::move(m), call_timeout(timeout),
               detail::result_handler<R>(fut, rrefs_, executor()), std::move(what));
  return fut;
}

}  // namespace tdist::rpc
