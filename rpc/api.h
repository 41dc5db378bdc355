#pragma once
// The RPC API (torch.distributed.rpc's, in C++):
//
//   #include "tdist/rpc/api.h"
//   namespace rpc = tdist::rpc;
//
//   int64_t add(int64_t a, int64_t b) { return a + b; }
//
//   int main() {
//     rpc::register_function("add", &add);
//     rpc::RpcOptions opts;                      // init_method "env://", rpc_timeout 60 s
//     rpc::init_rpc("worker" + std::to_string(rank), rank, world_size, opts);
//     if (rank == 0) {
//       int64_t s = rpc::rpc_sync<int64_t>("worker1", "add", int64_t{1}, int64_t{2});
//       rpc::Future<int64_t> f = rpc::rpc_async<int64_t>(1, "add", int64_t{3}, int64_t{4});
//       rpc::RRef<Counter> c = rpc::remote<Counter>("worker1", "Counter", int64_t{0});
//     }
//     rpc::shutdown();                           // waits for every worker's outstanding work
//   }
//
// The free functions use the calling thread's current agent: the one init_rpc() started on this
// thread, or on the agent's own worker threads the agent running the call (so a function called
// over RPC may itself call rpc_sync); otherwise the process's first agent. Arguments are typed:
// the callee checks the call's signature (signature.h). A per-call timeout goes right after the
// function name: rpc_sync<int64_t>("w1", "add", rpc::Timeout{Millis(500)}, a, b).

#include <memory>
#include <string>
#include <utility>

#include "tdist/rpc/agent.h"
#include "tdist/rpc/errors.h"
#include "tdist/rpc/future.h"
#include "tdist/rpc/registry.h"
#include "tdist/rpc/rref.h"
#include "tdist/rpc/types.h"

namespace tdist::rpc {

// Starts this worker's agent and waits until all world_size workers have joined. The agent
// becomes the calling thread's current agent (and the process's, if it has none).
void init_rpc(const std::string& name, int rank, int world_size, RpcOptions options = {});
// Shuts down the current agent (Note [RPC graceful shutdown]) and forgets it.
void shutdown(bool graceful = true);

// The current agent; Error when RPC is not initialized.
std::shared_ptr<RpcAgent> current_agent();
// Sets the calling thread's current agent (nullptr: back to the process's).
void set_current_agent(std::shared_ptr<RpcAgent> agent);

// Inside a function or method that runs for a request from another worker (or this one): the
// rank of the worker that sent it, as its connection's handshake established; -1 on any other
// thread. Lets a function decide what the caller may do.
int current_caller();

WorkerInfo get_worker_info();  // this worker
WorkerInfo get_worker_info(const std::string& name);
WorkerInfo get_worker_info(int rank);

template <class R, class... A>
Future<R> rpc_async(const To& to, const std::string& fn, A&&... args) {
  return current_agent()->rpc_async<R>(to, fn, std::forward<A>(args)...);
}
template <class R, class... A>
R rpc_sync(const To& to, const std::string& fn, A&&... args) {
  return current_agent()->rpc_sync<R>(to, fn, std::forward<A>(args)...);
}
template <class T, class... A>
RRef<T> remote(const To& to, const std::string& fn, A&&... args) {
  return current_agent()->remote<T>(to, fn, std::forward<A>(args)...);
}
// An RRef to a value owned by this worker (torch's RRef(value)).
template <class T>
RRef<std::decay_t<T>> make_rref(T&& value) {
  return make_rref(current_agent(), std::forward<T>(value));
}

}  // namespace tdist::rpc
