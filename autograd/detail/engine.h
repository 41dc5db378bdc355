#pragma once
// Internal functions of distributed autograd (Note [Distributed backward] in engine.cpp).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace tdist::autograd::detail {

// Registered RPC functions (tdist.* names are reserved for tdist's own).
inline constexpr const char* kBackwardFn = "tdist.autograd.backward";
inline constexpr const char* kReleaseFn = "tdist.autograd.release";

// BACKWARD: gradients for this worker's SendRpcBackward nodes, by autograd message id.
void handle_backward(int64_t context_id,
                     std::vector<std::pair<int64_t, std::vector<at::Tensor>>> batch);
// RELEASE from worker rank `from`.
void handle_release(int64_t context_id, int32_t from);

// Installs the rpc hooks (hooks.cpp).
void install_hooks();

}  // namespace tdist::autograd::detail
