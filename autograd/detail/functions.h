#pragma once
// The two autograd graph nodes that distributed autograd adds at RPC boundaries
// (Note [Distributed backward] in autograd/engine.cpp). Internal; includes torch's autograd
// internals.

#include <torch/csrc/autograd/function.h>

#include <cstdint>
#include <string>

namespace tdist::autograd::detail {

// On the sender of a message whose tensors require grad: one input per such tensor, its next
// edges are those tensors' gradient edges. A distributed backward starts the local engine here
// with the gradients the receiver sends back; it passes them through unchanged.
struct SendRpcBackward : public torch::autograd::Node {
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    return std::move(grads);
  }
  std::string name() const override { return "tdist::autograd::SendRpcBackward"; }
};

// On the receiver: the grad_fn of the received tensors that required grad on the sender. Never
// executed: distributed backward captures the gradients that reach its inputs and sends them to
// the sender's SendRpcBackward (worker `from`, message `message_id` of context `context_id`).
struct RecvRpcBackward : public torch::autograd::Node {
  RecvRpcBackward(int64_t context_id, int from, int64_t message_id)
      : context_id(context_id), from(from), message_id(message_id) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&&) override;
  std::string name() const override { return "tdist::autograd::RecvRpcBackward"; }

  const int64_t context_id;
  const int from;
  const int64_t message_id;
};

}  // namespace tdist::autograd::detail
