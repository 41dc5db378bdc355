// Distributed backward (FAST mode of PyTorch's "Distributed Autograd Design").
//
// Note [Distributed backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Recording (hooks.cpp, Note [Autograd frame header]). Inside a context every call-type request
// carries the context id; the callee joins the context (creating its part lazily) and runs the
// call with it current, so nested calls carry it on. When a request's arguments or a response's
// result hold tensors that require grad, the sender adds a SendRpcBackward S (inputs: those
// tensors; next edges: their gradient edges) to its part of the context under a fresh autograd
// message id m, and the receiver makes a RecvRpcBackward R(sender, m) the grad_fn of the
// received copies. Each worker remembers the ranks it exchanged messages with in the context.
//
// Backward. backward(ctx, roots) runs on the context's creator. A *local pass* on a worker, from
// root edges with gradients, is:
//   1. walk the graph from the root edges; the walk stops at AccumulateGrad nodes (leaves) and
//      at RecvRpcBackward nodes, which are collected;
//   2. run libtorch's engine from the root edges with the collected nodes' inputs as its
//      outputs (accumulate_grad = false): the engine sums, per input, the gradients arriving
//      over every local path, and executes only the nodes between the roots and those outputs
//      (neither AccumulateGrad nor RecvRpcBackward ever runs);
//   3. add each leaf's gradient into the context's gradient map (never into .grad); then, when
//      some of the leaves' gradient accumulators have post hooks (DDP's Reducer hooks there),
//      run those hooks as libtorch's engine would after accumulating, inside a graph task of
//      libtorch's engine (so that they may queue final callbacks, which run before the pass
//      goes on) and with the context current as the thread's LeafGradients
//      (core/leaf_gradients.h), through which a hook reads and rewrites the gradient in the
//      context (Note [DDP bucketing] 9 in ddp/reducer.h). A hooked leaf's entry is a tensor of
//      its own (not shared with another leaf's), so that rewriting it in place is safe. The
//      hooks run after the pass's local computation, not interleaved with it: DDP's allreduce
//      does not overlap this backward;
//   4. group the gradients that reached each RecvRpcBackward by its sender, send each sender one
//      BACKWARD request (tdist.autograd.backward: context, [(message id, gradients)]), wait for
//      all the answers and fail with the first error.
// The creator's pass starts from the roots' gradient edges with gradient 1. A worker answering
// BACKWARD starts a local pass from the named SendRpcBackward nodes' inputs with the received
// gradients (one pass for the whole batch), and answers only when its own step 4 is answered.
// So the creator's backward returns when every pass it caused, transitively, has finished:
// completion travels back in the answers, and the first failure (a worker died: the connection
// fails at once; or hangs: the call times out after the RPC timeout) travels back as an error
// naming the worker.
//
// Why the sum is right: every backward function is linear in its incoming gradients. FAST mode
// does not count dependencies across workers: a SendRpcBackward reached by several gradient
// batches (the same tensor reaching the creator over two remote paths) runs a pass per batch,
// each with a part of the gradient; the parts add up in the gradient map to the full gradient.
// Because a graph part may run several times in one backward, every pass keeps the graph
// (keep_graph = true); the graph is freed with the context. retain_graph = false marks the
// context so that a second backward fails, as torch's does.
//
// Cleanup (context.cpp). When the Context guard ends on the creator, its part is removed and a
// RELEASE request (tdist.autograd.release) goes to every worker it exchanged messages with; each
// worker that still has the context removes it and forwards RELEASE to the workers it knew
// (except the sender), and answers when those answered. A worker that already released it
// answers at once, so cycles end. Unreachable workers are logged and skipped.
//
// Limits: each BACKWARD (and nested call) waiting for its answer holds one of the waiting
// worker's RPC threads, so a chain deeper than RpcOptions::num_worker_threads round trips
// through one worker would wait for a free thread until the RPC timeout. A method call on an
// RRef whose value is still being created runs later on another thread, without the context
// current (its result is still recorded).
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <unordered_set>

#include "tdist/autograd/context.h"
#include "tdist/autograd/detail/container.h"
#include "tdist/autograd/detail/engine.h"
#include "tdist/autograd/detail/functions.h"
#include "tdist/core/leaf_gradients.h"
#include "tdist/core/logging.h"
#include "tdist/rpc/api.h"

namespace tdist::autograd::detail {
namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using GradBatch = std::vector<std::pair<int64_t, std::vector<at::Tensor>>>;

// A context's part as the gradients of its leaves (step 3).
class ContextLeafGradients : public tdist::LeafGradients {
 public:
  explicit ContextLeafGradients(std::shared_ptr<ContextState> st) : st_(std::move(st)) {}
  void with_gradient(const at::Tensor& leaf,
                     const std::function<void(at::Tensor& grad)>& fn) override {
    std::lock_guard<std::mutex> lock(st_->mu);
    auto it = st_->grads.find(leaf);
    if (it != st_->grads.end()) {
      fn(it->second);
      return;
    }
    at::Tensor grad;
    fn(grad);
    if (grad.defined()) st_->grads.emplace(leaf, std::move(grad));
  }

 private:
  const std::shared_ptr<ContextState> st_;
};

// Runs the post hooks of `leaves` (accumulator, the gradient it received) with the context as
// the thread's LeafGradients, as the one node of a graph task of libtorch's engine (step 3).
struct RunLeafHooks : Node {
  std::vector<std::pair<std::shared_ptr<Node>, at::Tensor>> leaves;
  std::shared_ptr<tdist::LeafGradients> grads;

  torch::autograd::variable_list apply(torch::autograd::variable_list&& /*unused*/) override {
    tdist::LeafGradientsScope scope(grads);
    const torch::autograd::variable_list no_outputs;
    for (auto& [acc, g] : leaves) {
      for (const auto& hook : acc->post_hooks()) (*hook)(no_outputs, {g});
    }
    return {};
  }
};

void run_leaf_hooks(const std::shared_ptr<ContextState>& st,
                    std::vector<std::pair<std::shared_ptr<Node>, at::Tensor>> leaves) {
  auto node = std::make_shared<RunLeafHooks>();
  node->leaves = std::move(leaves);
  node->grads = std::make_shared<ContextLeafGradients>(st);
  at::Tensor seed = at::zeros({});
  node->add_input_metadata(seed);
  torch::autograd::Engine::get_default_engine().execute(
      {Edge(node, 0)}, {seed}, /*keep_graph=*/false, /*create_graph=*/false,
      /*accumulate_grad=*/true, /*outputs=*/{});
}

// One local pass (steps 1-3); returns the gradients to send, by sender rank (step 4).
std::map<int, GradBatch> local_pass(const std::shared_ptr<ContextState>& state,
                                    const torch::autograd::edge_list& roots,
                                    const torch::autograd::variable_list& grads) {
  ContextState& st = *state;
  torch::autograd::edge_list outputs;
  std::vector<torch::autograd::AccumulateGrad*> leaves;  // per output, or null
  std::vector<RecvRpcBackward*> recvs;                   // per output, or null
  std::unordered_set<Node*> seen;
  std::vector<Node*> stack;
  for (const auto& e : roots) {
    if (e.function && seen.insert(e.function.get()).second) stack.push_back(e.function.get());
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(n)) {
      outputs.emplace_back(n->getptr(), 0);
      leaves.push_back(acc);
      recvs.push_back(nullptr);
      continue;
    }
    if (auto* recv = dynamic_cast<RecvRpcBackward*>(n)) {
      if (recv->context_id != st.id) {
        throw InvalidArgument(str("the graph of context ", st.id,
                                  " reaches a tensor received in context ", recv->context_id));
      }
      for (uint32_t i = 0; i < n->num_inputs(); ++i) {
        outputs.emplace_back(n->getptr(), i);
        leaves.push_back(nullptr);
        recvs.push_back(recv);
      }
      continue;
    }
    for (const auto& e : n->next_edges()) {
      if (e.function && seen.insert(e.function.get()).second) stack.push_back(e.function.get());
    }
  }
  if (outputs.empty()) return {};
  auto results = torch::autograd::Engine::get_default_engine().execute(
      roots, grads, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/false,
      outputs);
  std::map<int, GradBatch> out;
  std::map<RecvRpcBackward*, std::vector<at::Tensor>> by_recv;
  std::vector<std::pair<std::shared_ptr<Node>, at::Tensor>> hooked;
  std::unique_lock<std::mutex> lock(st.mu);
  for (size_t i = 0; i < outputs.size(); ++i) {
    const at::Tensor& g = results[i];
    if (leaves[i]) {
      if (!g.defined()) continue;
      const at::Tensor& var = leaves[i]->variable;
      const bool has_hooks = !leaves[i]->post_hooks().empty();
      if (has_hooks) hooked.emplace_back(outputs[i].function, g);
      auto it = st.grads.find(var);
      if (it == st.grads.end()) {
        st.grads.emplace(var, has_hooks ? g.detach().clone() : g.detach());
      } else {
        it->second = it->second + g.detach();
      }
    } else {
      auto& v = by_recv[recvs[i]];
      v.resize(recvs[i]->num_inputs());
      v[outputs[i].input_nr] = g.defined() ? g.detach() : g;
    }
  }
  for (auto& [recv, gs] : by_recv) {
    bool any = false;
    for (const auto& g : gs) any = any || g.defined();
    if (any) out[recv->from].emplace_back(recv->message_id, std::move(gs));
  }
  lock.unlock();
  if (!hooked.empty()) run_leaf_hooks(state, std::move(hooked));
  return out;
}

// Step 4: sends each sender its batch and waits for all answers.
void propagate(rpc::RpcAgent& agent, int64_t context_id, std::map<int, GradBatch> batches) {
  if (batches.empty()) return;
  ThreadContextScope none(0);  // BACKWARD itself carries no autograd header
  std::vector<std::pair<int, rpc::Future<void>>> futures;
  for (auto& [rank, batch] : batches) {
    futures.emplace_back(rank,
                         agent.rpc_async<void>(rank, kBackwardFn, context_id, std::move(batch)));
  }
  std::exception_ptr first;
  for (auto& [rank, f] : futures) {
    try {
      f.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace

// BACKWARD's handler: a local pass from the named SendRpcBackward nodes.
void handle_backward(int64_t context_id, GradBatch batch) {
  auto agent = rpc::current_agent();
  auto c = container_for(*agent);
  auto st = c->find(context_id);
  TDIST_CHECK_ARG(st != nullptr, "distributed autograd context ", context_id,
                  " is not known on worker '", agent->info().name, "' (released?)");
  torch::autograd::edge_list roots;
  torch::autograd::variable_list grads;
  {
    std::lock_guard<std::mutex> lock(st->mu);
    for (auto& [message_id, gs] : batch) {
      auto it = st->sends.find(message_id);
      TDIST_CHECK_ARG(it != st->sends.end(), "no autograd message ", message_id, " in context ",
                      context_id, " on worker '", agent->info().name, "'");
      const auto& send = it->second;
      TDIST_CHECK_ARG(gs.size() == send->num_inputs(), "autograd message ", message_id, " has ",
                      send->num_inputs(), " gradients, got ", gs.size());
      for (size_t i = 0; i < gs.size(); ++i) {
        if (!gs[i].defined()) continue;
        roots.emplace_back(send, static_cast<uint32_t>(i));
        grads.push_back(std::move(gs[i]));
      }
    }
  }
  if (roots.empty()) return;
  propagate(*agent, context_id, local_pass(st, roots, grads));
}

}  // namespace tdist::autograd::detail

namespace tdist::autograd {

void backward(int64_t context_id, const std::vector<at::Tensor>& roots, bool retain_graph) {
  auto agent = rpc::current_agent();
  auto c = detail::container_for(*agent);
  auto st = c->find(context_id);
  TDIST_CHECK_ARG(st != nullptr, "backward: distributed autograd context ", context_id,
                  " is not known on worker '", agent->info().name, "' (never created or released)");
  TDIST_CHECK_ARG(detail::context_creator(context_id) == agent->rank(), "backward: context ",
                  context_id, " was created by worker rank ", detail::context_creator(context_id),
                  "; run backward there, not on worker '", agent->info().name, "'");
  TDIST_CHECK_ARG(!roots.empty(), "backward: no roots");
  torch::autograd::edge_list edges;
  torch::autograd::variable_list grads;
  for (size_t i = 0; i < roots.size(); ++i) {
    const at::Tensor& r = roots[i];
    TDIST_CHECK_ARG(r.defined(), "backward: root ", i, " is an undefined tensor");
    TDIST_CHECK_ARG(r.requires_grad(), "backward: root ", i,
                    " does not require grad and has no grad_fn");
    TDIST_CHECK_ARG(r.numel() == 1, "backward: root ", i, " has ", r.numel(),
                    " elements; roots must be scalars");
    edges.push_back(torch::autograd::impl::gradient_edge(r));
    grads.push_back(at::ones_like(r, at::MemoryFormat::Preserve).detach());
  }
  std::lock_guard<std::mutex> serial(st->backward_mu);
  {
    std::lock_guard<std::mutex> lock(st->mu);
    TDIST_CHECK_ARG(!st->graph_used, "backward: context ", context_id,
                    " already ran a backward without retain_graph; pass retain_graph = true to "
                    "the first one to run a second");
  }
  // The error keeps its kind (a worker that stopped answering: TimeoutError; a lost connection:
  // NetworkError), so callers can tell a hung worker from a dead one.
  const auto failed = [&](const std::exception& e) {
    return str("distributed backward of context ", context_id, " on worker '", agent->info().name,
               "' failed: ", e.what());
  };
  try {
    detail::propagate(*agent, context_id, detail::local_pass(st, edges, grads));
  } catch (const TimeoutError& e) {
    throw TimeoutError(failed(e));
  } catch (const NetworkError& e) {
    throw NetworkError(failed(e));
  } catch (const std::exception& e) {
    throw Error(failed(e));
  }
  if (!retain_graph) {
    std::lock_guard<std::mutex> lock(st->mu);
    st->graph_used = true;
  }
}

}  // namespace tdist::autograd
