#pragma once
// Options of DistributedDataParallel, named as PyTorch's Python DDP names them.

#include <chrono>

namespace tdist::ddp {

struct DDPOptions {
  // Buckets after the first close once they hold this many MiB of gradients (PyTorch's default 25).
  double bucket_cap_mb = 25.0;
  // The first bucket (the gradients backward produces first) closes at this many MiB so that
  // communication starts early (PyTorch's 1 MiB). Not a PyTorch option; min'ed with bucket_cap_mb.
  double first_bucket_cap_mb = 1.0;
  // Broadcast buffers (BatchNorm statistics, ...) from rank 0 before each forward that syncs.
  bool broadcast_buffers = true;
  // Walk the autograd graph from forward's outputs to find parameters that will get no gradient
  // and mark them ready at once; their gradients are left untouched where no rank used them.
  bool find_unused_parameters = false;
  // Gradients are views into the bucket buffers: no copy in and out, less memory. Optimizers
  // must not replace `.grad` by another tensor (zero_grad(set_to_none) is fine: the view is
  // rebound at the next backward). Without it, CPU gradients are still not copied with the
  // built-in hook: they are reduced where they lie (Note [DDP bucketing] 11 in reducer.h); the
  // buckets keep the gradients that cannot be (CUDA, other layouts, a registered comm hook).
  bool gradient_as_bucket_view = false;
  // The set of used parameters and the order of gradients do not change between iterations:
  // unused parameters are found once (first iteration) instead of every iteration.
  bool static_graph = false;
  // How long the end of backward waits for a bucket's communication (and construction for its
  // checks) before failing with TimeoutError; negative: the process group's own timeout.
  std::chrono::milliseconds timeout{-1};
};

}  // namespace tdist::ddp
