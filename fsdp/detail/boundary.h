#pragma once
// Autograd nodes at a unit's boundary (Note [Sharded data parallel] in tdist/fsdp/fully_shard.h):
// libtorch's C++ modules have no forward hooks and its tensors no "before this backward" hook,
// so FSDP threads its own identity node through the tensors that enter and leave a unit.
//
// insert_backward_hook(tensors, fn, name): replaces each tensor of `tensors` that requires grad
// by an alias (same data) whose grad_fn is one node; in backward that node runs fn() once,
// when the gradients of all those tensors that backward reaches are ready, and then passes them
// on unchanged. Returns whether it inserted a node (false in no-grad mode or when no tensor
// requires grad). On the outputs of a unit the node runs before any of the unit's backward;
// on its inputs, after all of it that leads to them.

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace tdist::fsdp::detail {

bool insert_backward_hook(std::vector<at::Tensor>& tensors, std::function<void()> fn,
                          std::string name);

}  // namespace tdist::fsdp::detail
