#pragma once
// The extension point through which tdist::autograd (a module layered on rpc) sees RPC traffic.
// rpc does not depend on autograd: autograd installs one process-wide AutogradHooks object and
// the agent calls it at four points. With no hooks installed, or outside a distributed autograd
// context, nothing is added to a frame (plain RPC costs one pointer load and one thread-local
// check per message).
//
// A frame that carries autograd information has kFlagAutograd set and its payload starts with a
// header that only the hooks write and read (Note [Autograd frame header] in
// autograd/detail/header.h); the hooks strip it before the agent's handlers read the payload.
//
// Thread safety: the hooks are called from callers' threads, worker threads and connection
// reader threads at once; an implementation must be thread safe. Hooks may throw: on the send
// side the call fails with that error, on the receive side the request is answered with an error
// (a response: the pending call fails).

#include <memory>

#include "tdist/rpc/message.h"

namespace tdist::rpc {

class RpcAgent;

class AutogradHooks {
 public:
  virtual ~AutogradHooks() = default;
  // A request (of any type) about to be sent to rank `to` from the calling thread.
  virtual void on_send_request(RpcAgent& agent, int to, OutMessage& m) = 0;
  // The answer (response or error) to request `m.id` of rank `to`, about to be sent.
  virtual void on_send_response(RpcAgent& agent, int to, OutMessage& m) = 0;
  // A request with kFlagAutograd, before its handler runs; the returned object (may be null) is
  // kept alive while the handler runs on this thread.
  virtual std::shared_ptr<void> on_recv_request(RpcAgent& agent, Message& m) = 0;
  // A response with kFlagAutograd, before its result is decoded.
  virtual void on_recv_response(RpcAgent& agent, Message& m) = 0;
};

// Installs the process-wide hooks (once; later calls with another object throw). The object
// must live until the process exits.
void set_autograd_hooks(AutogradHooks* hooks);
// The installed hooks, or nullptr.
AutogradHooks* autograd_hooks();

}  // namespace tdist::rpc
