#include "tdist/core/leaf_gradients.h"

namespace tdist {
namespace {
thread_local std::shared_ptr<LeafGradients> t_current;
}  // namespace

std::shared_ptr<LeafGradients> current_leaf_gradients() { return t_current; }

LeafGradientsScope::LeafGradientsScope(std::shared_ptr<LeafGradients> g)
    : previous_(std::exchange(t_current, std::move(g))) {}

LeafGradientsScope::~LeafGradientsScope() { t_current = std::move(previous_); }

void with_leaf_gradient(const std::shared_ptr<LeafGradients>& g, const at::Tensor& leaf,
                        const std::function<void(at::Tensor& grad)>& fn) {
  if (g) {
    g->with_gradient(leaf, fn);
  } else {
    // mutable_grad() is declared on a const Tensor (the grad lives in its autograd meta).
    fn(leaf.mutable_grad());
  }
}

}  // namespace tdist
