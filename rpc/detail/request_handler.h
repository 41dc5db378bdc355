#pragma once
// RequestHandler: answers the requests the Dispatcher (rpc/detail/dispatcher.h) reads, on the
// agent's worker threads: calls of registered functions (CALL), remote calls that make an owner
// RRef here (REMOTE_CALL), fetches and method calls of the RRefs owned here (RREF_FETCH,
// RREF_METHOD_CALL, RREF_METHOD_REMOTE), fork requests (RREF_FORK_REQUEST) and the RRefs'
// control messages (RREF_USER_DELETE, RREF_CHILD_ACCEPT).
//
// Each request gets exactly one answer: its result (RESPONSE) or an error (ERROR) naming this
// worker. An answer that waits for an RRef's value goes out from the thread that sets it (Note
// [RRef protocol] invariant 5), and only while the agent lives; a fork request is registered on
// the reader thread, in order (invariant 7), and answered from the pool.
//
// Locking: none of its own (the RRefContext and the connections lock themselves).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "tdist/rpc/detail/agent_parts.h"
#include "tdist/rpc/detail/connection.h"
#include "tdist/rpc/detail/message.h"
#include "tdist/rpc/detail/rref_context.h"
#include "tdist/rpc/types.h"

namespace tdist::rpc::detail {

class RequestHandler {
 public:
  // `agent` owns the handler: the autograd hooks are told about it, and an answer that waits
  // for an RRef's value holds it. `post` runs a task on the agent's pool (Dispatcher::post);
  // `peer_name` names a worker rank in log lines.
  RequestHandler(RpcAgent& agent, WorkerInfo self, std::shared_ptr<RRefContext> rrefs,
                 std::function<bool(std::function<void()>)> post,
                 std::function<std::string(int)> peer_name);
  RequestHandler(const RequestHandler&) = delete;
  RequestHandler& operator=(const RequestHandler&) = delete;

  // On a worker thread; answers the request or arranges for it to be answered.
  void handle_request(const std::shared_ptr<Connection>& conn, Message& msg);
  // On the connection's reader thread, in order: registers the fork (Note [RRef protocol]
  // invariant 7); the answer goes out from the pool.
  void handle_fork_request(const std::shared_ptr<Connection>& conn, const Message& msg);
  // Answers request `id` with an ERROR carrying `message`.
  void reply_error(const std::shared_ptr<Connection>& conn, uint64_t id,
                   const std::string& message);

 private:
  void handle_call(const std::shared_ptr<Connection>& conn, Message& msg);
  void handle_remote_call(const std::shared_ptr<Connection>& conn, Message& msg);
  void handle_fetch(const std::shared_ptr<Connection>& conn, Message& msg);
  void handle_method(const std::shared_ptr<Connection>& conn, std::shared_ptr<Message> msg,
                     bool remote);
  void handle_control(const std::shared_ptr<Connection>& conn, Message& msg);
  // InvalidArgument unless worker `from` holds a fork of `id` or is this worker.
  void check_fork_held(const RRefId& id, int from) const;
  void reply_value(const std::shared_ptr<Connection>& conn, uint64_t id, int to,
                   const AnyValue& value);
  void reply_empty(const std::shared_ptr<Connection>& conn, uint64_t id, Bytes body = {});
  void send_reply(const std::shared_ptr<Connection>& conn, OutMessage&& m);

  // Constant after construction.
  RpcAgent& agent_;
  const WorkerInfo self_;
  const std::shared_ptr<RRefContext> rrefs_;
  const std::function<bool(std::function<void()>)> post_;
  const std::function<std::string(int)> peer_name_;
};

}  // namespace tdist::rpc::detail
