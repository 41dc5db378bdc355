#include "tdist/pipeline/detail/split_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <unordered_map>
#include <utility>

#include "tdist/core/error.h"

namespace tdist::pipeline::detail {

namespace ag = torch::autograd;

namespace {

// Keeps the gradients a node is called with (a copy of the list: the tensors are shared).
struct KeepGradients : ag::FunctionPreHook {
  explicit KeepGradients(std::shared_ptr<ag::variable_list> kept) : kept(std::move(kept)) {}
  ag::variable_list operator()(const ag::variable_list& grads) override {
    *kept = grads;
    return grads;
  }
  std::shared_ptr<ag::variable_list> kept;
};

// What the walk knows of a node: whether the input's gradient flows through it, and which
// parameters' gradients do (reach[p]).
struct Reach {
  bool input = false;
  std::vector<char> params;
};

}  // namespace

struct LayerSplit::Fork {
  std::shared_ptr<ag::Node> node;
  std::shared_ptr<ag::variable_list> kept;  // what I handed the node
  ag::edge_list outputs;                    // the parameters it reaches off the input's path
};

LayerSplit::LayerSplit(const at::Tensor& in, const at::Tensor& out,
                       const std::vector<at::Tensor>& params) {
  if (!in.requires_grad() || !out.grad_fn() || params.empty()) return;
  const ag::Node* input = ag::impl::gradient_edge(in).function.get();
  std::unordered_map<const ag::Node*, size_t> param_of;  // accumulator -> index in params
  std::vector<ag::Edge> param_edges;
  for (size_t i = 0; i < params.size(); ++i) {
    param_edges.push_back(ag::impl::gradient_edge(params[i]));
    param_of.emplace(param_edges.back().function.get(), i);
  }
  const size_t P = params.size();
  // Post-order over the graph (a DAG): a node's Reach once all its children's are known.
  std::unordered_map<const ag::Node*, Reach> reach;
  std::vector<std::pair<ag::Node*, size_t>> stack{{out.grad_fn().get(), 0}};
  reach[out.grad_fn().get()];
  std::vector<ag::Node*> order;  // children before parents
  while (!stack.empty()) {
    auto& [node, next] = stack.back();
    if (next < node->num_outputs()) {
      ag::Node* child = node->next_edge(next++).function.get();
      if (child != nullptr && reach.find(child) == reach.end()) {
        reach[child];
        stack.emplace_back(child, 0);
      }
      continue;
    }
    Reach& r = reach[node];
    r.params.assign(P, 0);
    r.input = node == input;
    if (auto it = param_of.find(node); it != param_of.end()) r.params[it->second] = 1;
    for (const auto& e : node->next_edges()) {
      if (!e.function) continue;
      const Reach& c = reach[e.function.get()];
      r.input = r.input || c.input;
      for (size_t p = 0; p < P; ++p) r.params[p] = r.params[p] || c.params[p];
    }
    order.push_back(node);
    stack.pop_back();
  }
  if (!reach[out.grad_fn().get()].input) return;  // the output does not depend on the input
  // The forks: nodes on the input's path with an edge off it that leads to parameters.
  std::vector<Fork> forks;
  for (ag::Node* node : order) {
    const Reach& r = reach[node];
    if (!r.input) continue;
    std::vector<char> off(P, 0), on(P, 0);
    for (const auto& e : node->next_edges()) {
      if (!e.function) continue;
      const Reach& c = reach[e.function.get()];
      auto& into = c.input ? on : off;
      for (size_t p = 0; p < P; ++p) into[p] = into[p] || c.params[p];
    }
    Fork f;
    for (size_t p = 0; p < P; ++p) {
      if (!off[p]) continue;
      if (on[p]) return;  // W from here would also go down the input's path to p: not exact
      f.outputs.push_back(param_edges[p]);
    }
    if (f.outputs.empty()) continue;
    f.node = node->getptr();
    forks.push_back(std::move(f));
  }
  // (A parameter no fork reaches is not used by the output: it gets no gradient, as in the
  // whole backward.)
  for (auto& f : forks) {
    f.kept = std::make_shared<ag::variable_list>();
    f.node->add_pre_hook(std::make_unique<KeepGradients>(f.kept));
  }
  forks_ = std::move(forks);
  exact_ = true;
}

LayerSplit::~LayerSplit() = default;

void LayerSplit::weight_grads() {
  TDIST_CHECK(exact_, "LayerSplit::weight_grads: the layer's backward cannot be split");
  for (auto& f : forks_) {
    // Every fork is on the input's path, so I ran it (a node always gets its whole input list).
    TDIST_CHECK(!f.kept->empty(), "LayerSplit::weight_grads before the input gradient pass");
    ag::edge_list roots;
    ag::variable_list grads;
    for (size_t i = 0; i < f.kept->size(); ++i) {
      if (!(*f.kept)[i].defined()) continue;
      roots.emplace_back(f.node, static_cast<uint32_t>(i));
      grads.push_back((*f.kept)[i]);
    }
    f.kept->clear();
    if (roots.empty()) continue;  // I sent no gradient through this node
    ag::Engine::get_default_engine().execute(roots, grads, /*keep_graph=*/true,
                                             /*create_graph=*/false, /*accumulate_grad=*/true,
                                             f.outputs);
  }
}

}  // namespace tdist::pipeline::detail
