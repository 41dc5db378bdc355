#pragma once
// Distributed autograd (torch.distributed.autograd, in C++). See Note [Distributed backward] in
// autograd/engine.cpp for the algorithm.
//
//   namespace dist_autograd = tdist::autograd;
//   {
//     dist_autograd::Context ctx;                         // a new context, current on this thread
//     at::Tensor y = rref.rpc_sync<at::Tensor>("forward", x);   // recorded: send/recv edges
//     at::Tensor loss = (y - target).pow(2).mean();
//     dist_autograd::backward(ctx.id(), {loss});          // runs on every worker involved
//     dist_autograd::GradientMap g = dist_autograd::get_gradients(ctx.id());  // this worker's
//     dist_opt.step(ctx.id());                            // optim/distributed_optimizer.h
//   }                                                     // every worker frees the context
//
// Every RPC made on a thread with a current context (rpc_sync, rpc_async, remote, RRef method
// calls, to_here) carries the context id; the callee runs the call in that context (created
// there on first use), so nested calls carry it on. Tensors that require grad in a request's
// arguments or in a response's result add a SendRpcBackward on the sender and a RecvRpcBackward
// on the receiver. Gradients of the leaves a worker holds accumulate in its part of the context
// (get_gradients), never in `.grad`.
//
// All functions use the calling thread's current RPC agent (rpc/api.h). Every worker that takes
// part must have tdist::autograd linked (it installs itself into rpc when its library loads;
// a program linking it statically calls tdist::autograd::init() before init_rpc).
// Thread safety: every function may be called from any thread; a context may be used from
// several threads (the id is what travels), but backward of one context runs one at a time.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

namespace tdist::rpc {
class RpcAgent;
}

namespace tdist::autograd {

// Tensors as map keys by identity (the same TensorImpl), like PyTorch's dict of gradients.
struct TensorIdentityHash {
  size_t operator()(const at::Tensor& t) const {
    return std::hash<const void*>()(t.unsafeGetTensorImpl());
  }
};
struct TensorIdentityEqual {
  bool operator()(const at::Tensor& a, const at::Tensor& b) const {
    return a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl();
  }
};
// Leaf tensor -> its gradient accumulated in a context.
using GradientMap =
    std::unordered_map<at::Tensor, at::Tensor, TensorIdentityHash, TensorIdentityEqual>;

// A distributed autograd context (RAII): created on the calling thread's current agent, current
// on the calling thread until destroyed. Its id is unique across workers (the creator's rank in
// the top 16 bits). The destructor makes the context current no more and frees it on this worker
// and on every worker that took part (it waits up to the RPC timeout for their answers; a worker
// that cannot be reached is logged and skipped). Contexts do not nest on one thread
// (InvalidArgument). Not copyable or movable.
class Context {
 public:
  Context();
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int64_t id() const { return id_; }

 private:
  std::shared_ptr<rpc::RpcAgent> agent_;
  int64_t id_ = 0;
};

// The calling thread's current context, if any (inside a Context's scope, or inside a call made
// from one).
std::optional<int64_t> current_context();

// Takes the calling thread out of its distributed autograd context for a scope (the RPCs it
// makes meanwhile add no send/recv edges to any graph), then restores the context it had. For
// calls that must not become part of a graph, such as DistributedOptimizer's own. Not copyable.
class NoContextScope {
 public:
  NoContextScope();
  ~NoContextScope();
  NoContextScope(const NoContextScope&) = delete;
  NoContextScope& operator=(const NoContextScope&) = delete;

 private:
  int64_t previous_;
};

// Runs the distributed backward pass of `context_id` from `roots` (tensors of one element that
// require grad; the gradient of each is 1) and returns when every worker it reached has
// finished. Must run on the worker that created the context. Without retain_graph, a second
// backward of the same context fails (as torch's does); the graph itself is freed when the
// context is. InvalidArgument for an unknown or released context, a context of another worker,
// or a bad root (nothing changes then); Error naming the worker when one fails, of the kind of
// the cause: NetworkError when its connection was lost, TimeoutError when it did not answer
// within the RPC timeout.
void backward(int64_t context_id, const std::vector<at::Tensor>& roots, bool retain_graph = false);

// The gradients this worker accumulated in `context_id` (a copy of the map; the tensors are
// shared). InvalidArgument for an unknown or released context.
GradientMap get_gradients(int64_t context_id);

// Installs distributed autograd into rpc (idempotent). Runs when the library loads; a program
// that links tdist::autograd statically calls it before init_rpc.
void init();

}  // namespace tdist::autograd
