#pragma once
// Dispatcher: where every frame a connection reads goes, and the worker pool that runs them.
//
// - on_message() runs on a connection's reader thread for every complete frame and never runs
//   user code there. A RREF_FORK_REQUEST is registered right there, in order (Note [RRef
//   protocol] invariant 7; its answer goes out from the pool). Any other request counts as
//   received and goes to the pool, where the autograd hook (rpc/autograd_hooks.h) sees it
//   first and the RequestHandler answers it, with current_caller() set to its sender. A
//   response or error completes its pending call (PendingCalls::take_response): an ERROR frame
//   becomes a RemoteError naming the remote worker; a response to a call that already timed
//   out or failed is dropped, and so is one that arrives on another connection than its request
//   left on (a peer answering somebody else's call), with a log line. A completion that may
//   send or destroy RRefs (on_pool, or a response carrying RRefs) runs on the pool, the others
//   on the reader thread.
// - Every request and completion counts as work in progress (PendingCalls) until it is done,
//   so graceful shutdown waits for it.
// - post(): every task on the pool keeps the agent alive until it ends, so dropping the agent's
//   last reference inside a handler is safe (it is then destroyed on its own worker thread,
//   which ThreadPool::stop allows).
//
// Locking: none of its own; the counts are atomic, the pool and PendingCalls lock themselves.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "tdist/rpc/detail/connection.h"
#include "tdist/rpc/detail/message.h"
#include "tdist/rpc/detail/pending_calls.h"
#include "tdist/rpc/detail/request_handler.h"
#include "tdist/rpc/detail/thread_pool.h"

namespace tdist::rpc {
class RpcAgent;
}  // namespace tdist::rpc

namespace tdist::rpc::detail {

class Dispatcher {
 public:
  // `agent` (which owns the dispatcher) is what the autograd hooks are told about and what each
  // pool task keeps alive; `handler` answers the requests.
  Dispatcher(RpcAgent& agent, RequestHandler& handler, PendingCalls& pending,
             std::unique_ptr<ThreadPool> pool);
  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  void on_message(const std::shared_ptr<Connection>& conn, Message&& msg);

  // Runs task on the pool, the agent kept alive until it ends; false once the pool stopped.
  bool post(std::function<void()> task);
  ThreadPool& pool() { return *pool_; }
  int64_t received() const { return received_.load(); }
  // Stops the pool (see ThreadPool::stop).
  void stop() { pool_->stop(); }

 private:
  void on_response(const std::shared_ptr<Connection>& conn, Message&& msg);

  // Constant after construction.
  RpcAgent& agent_;
  RequestHandler& handler_;
  PendingCalls& pending_;
  const std::unique_ptr<ThreadPool> pool_;

  std::atomic<int64_t> received_{0};
};

}  // namespace tdist::rpc::detail
