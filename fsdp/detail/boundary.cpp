#include "tdist/fsdp/detail/boundary.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

namespace tdist::fsdp::detail {
namespace {

struct BoundaryBackward : torch::autograd::Node {
  BoundaryBackward(std::function<void()> fn, std::string name)
      : fn_(std::move(fn)), name_(std::move(name)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    fn_();
    return std::move(grads);
  }
  std::string name() const override { return name_; }

 private:
  const std::function<void()> fn_;
  const std::string name_;
};

}  // namespace

bool insert_backward_hook(std::vector<at::Tensor>& tensors, std::function<void()> fn,
                          std::string name) {
  if (!at::GradMode::is_enabled()) return false;
  std::vector<size_t> picked;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].defined() && tensors[i].requires_grad()) picked.push_back(i);
  }
  if (picked.empty()) return false;
  auto node = std::make_shared<BoundaryBackward>(std::move(fn), std::move(name));
  torch::autograd::edge_list edges;
  for (size_t i : picked) edges.push_back(torch::autograd::impl::gradient_edge(tensors[i]));
  node->set_next_edges(std::move(edges));
  for (size_t i : picked) {
    // detach(): a new autograd identity on the same data, whose history is the node.
    at::Tensor alias = tensors[i].detach();
    torch::autograd::set_history(alias, node);
    tensors[i] = std::move(alias);
  }
  return true;
}

}  // namespace tdist::fsdp::detail
