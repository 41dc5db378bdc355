#pragma once
// The parts RpcAgent (rpc/agent.h) is composed of, declared for its header; each part's own
// header says what it owns and how it locks.

#include <memory>

namespace tdist::rpc {
class RpcAgent;
}  // namespace tdist::rpc

namespace tdist::rpc::detail {

class ConnectionTable;  // rpc/detail/connection_table.h
class Dispatcher;       // rpc/detail/dispatcher.h
class Membership;       // rpc/detail/membership.h
class PendingCalls;     // rpc/detail/pending_calls.h
class RequestHandler;   // rpc/detail/request_handler.h

// The thread-local agent of rpc/api.h's free functions (set on the agent's worker threads).
void set_thread_agent(std::weak_ptr<RpcAgent> agent);

}  // namespace tdist::rpc::detail
