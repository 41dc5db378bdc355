#pragma once
// Zero-bubble's split of one layer's backward into I (the gradient of the layer's input) and W
// (its weight gradients) without running the layer's backward twice (Note [Pipeline
// schedules], "The split").

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace tdist::pipeline::detail {

class LayerSplit {
 public:
  // `in`: the layer's input, a leaf; `out`: the layer's output; `params`: the layer's parameters
  // that require grad. Walks out's autograd graph (it ends at leaves: in and the parameters) and
  // finds the nodes where a parameter's gradient path leaves the input's, the forks; hooks each
  // to keep the gradients I hands it. Construct it before I runs over the graph.
  LayerSplit(const at::Tensor& in, const at::Tensor& out, const std::vector<at::Tensor>& params);
  ~LayerSplit();
  LayerSplit(const LayerSplit&) = delete;
  LayerSplit& operator=(const LayerSplit&) = delete;

  // Whether W can start at the forks: every parameter's gradient leaves the input's path, and
  // no fork's input-side edges lead to a parameter it also reaches directly (which W from that
  // fork would count twice). False: W must be the layer's whole backward.
  bool exact() const { return exact_; }

  // W, after I ran: one backward per fork from the gradients I handed it, into the parameters
  // it reaches off the input's path (each fork's node runs again for those outputs only).
  void weight_grads();

 private:
  struct Fork;
  std::vector<Fork> forks_;
  bool exact_ = false;
};

}  // namespace tdist::pipeline::detail
