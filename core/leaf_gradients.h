#pragma once
// Where a backward pass keeps the gradients of leaf tensors, when that is not `.grad`.
//
// libtorch's engine accumulates a leaf's gradient into `.grad` and then runs the post hooks of
// its gradient accumulator (DDP's Reducer hooks there). tdist::autograd's distributed backward
// keeps leaf gradients in its context instead, but it runs the same accumulator post hooks; while
// it does, a LeafGradients object for that context is current on the calling thread, and a hook
// that reads or rewrites the gradient (the Reducer: read it into a bucket, write the average
// back) goes through it instead of `.grad` (PyTorch's Reducer does the same with the thread's
// distributed autograd context).
//
// This lives in core because both sides sit on core and neither may depend on the other:
// ddp (core <- comm <- ddp) reads it, autograd (core <- rpc <- autograd) sets it.
//
// Thread safety: an implementation must be thread safe; the current object is per thread.

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <utility>

namespace tdist {

class LeafGradients {
 public:
  virtual ~LeafGradients() = default;
  // Calls fn with the gradient of `leaf` in this backward (undefined when it has none); fn may
  // read it, change it in place or assign another tensor to it. fn must not call back into this
  // object.
  virtual void with_gradient(const at::Tensor& leaf,
                             const std::function<void(at::Tensor& grad)>& fn) = 0;
};

// The calling thread's current LeafGradients, or nullptr (the gradients are in `.grad`).
std::shared_ptr<LeafGradients> current_leaf_gradients();

// Makes `g` current on the calling thread for a scope and restores the previous one.
class LeafGradientsScope {
 public:
  explicit LeafGradientsScope(std::shared_ptr<LeafGradients> g);
  ~LeafGradientsScope();
  LeafGradientsScope(const LeafGradientsScope&) = delete;
  LeafGradientsScope& operator=(const LeafGradientsScope&) = delete;

 private:
  std::shared_ptr<LeafGradients> previous_;
};

// Calls fn with `leaf`'s gradient: through `g` when it is set, else `leaf.mutable_grad()`.
void with_leaf_gradient(const std::shared_ptr<LeafGradients>& g, const at::Tensor& leaf,
                        const std::function<void(at::Tensor& grad)>& fn);

}  // namespace tdist
