#pragma once
// Reducer: averages the gradients of a set of parameters across the ranks of a process group,
// bucket by bucket, while backward runs (PyTorch's Reducer). DistributedDataParallel drives it.
//
// Note [DDP bucketing]
// ~~~~~~~~~~~~~~~~~~~~
// Parameters are grouped into buckets (assign_buckets): at construction in reverse parameter
// order (backward usually produces the last layer's gradients first), the first bucket capped at
// first_bucket_cap_mb and the rest at bucket_cap_mb. Invariants:
//  1. Every rank has the same buckets in the same order. At construction this holds because the
//     parameters were checked to match on every rank; at the single rebuild it holds because
//     rank 0 broadcasts its order and every rank buckets by it.
//  2. A post-hook on each parameter's gradient accumulator (run by the autograd engine right after
//     the gradient was accumulated into .grad) marks it ready: the gradient is copied into its
//     bucket view (with gradient_as_bucket_view, .grad is that view and nothing is copied; on
//     the CPU with the built-in hook it usually stays where it is: 11). A parameter is marked at
//     most once per backward; twice is an error.
//  3. A bucket is launched (its comm hook called) when all its gradients are ready AND every
//     bucket before it was launched: buckets are launched in index order on every rank, which
//     keeps the collectives in the same order everywhere (the process group requires it). The
//     allreduce of bucket i then runs while backward computes the gradients of later buckets.
//     Launches run without mu_ (a hook may query the Reducer, or wait for a thread that does),
//     by one thread at a time: the thread that finds launchable buckets while no other launches
//     becomes the launcher and launches, in order, every bucket that is (or becomes) ready; a
//     thread that marks a gradient ready meanwhile leaves its bucket to the launcher.
//  4. The first hook of a backward queues the end-of-backward callback (finalize) on the engine.
//     finalize requires every bucket launched (else: the parameters that got no gradient are
//     named, as PyTorch does), waits (without mu_) for every bucket's future and the used map's
//     (with the timeout), and writes the averaged gradients back into .grad.
//  5. Unused parameters (find_unused_parameters, or static_graph's first iteration): after forward,
//     the autograd graph is walked from the outputs; every parameter whose accumulator is not
//     reached is marked ready at once (its bucket view is zero, or its accumulated .grad). A used
//     map (1 where a rank used the parameter) is allreduced, issued by the launcher right after
//     the last bucket's hook returned (as PyTorch does): it is complete then, since every
//     parameter was marked, and it travels while the last bucket is still in flight. A parameter
//     no rank used keeps its .grad untouched (undefined stays undefined).
//  6. Rebuild: during the first synchronized backward the ready order is recorded. At the next
//     forward that syncs, rank 0's order is broadcast and every rank rebuilds its buckets in it
//     (once). With gradient_as_bucket_view (or 12) the .grad tensors move to the new views.
//     With the built-in hook each rank divides its gradients by the world size while copying
//     them into the bucket (in place, for a .grad that is the bucket view), and the allreduce
//     sums the quotients: the sum never exceeds the largest gradient, so fp16 gradients that
//     fit do not overflow to inf (world * |g| may not fit). This is PyTorch's order too. CPU
//     float and double buckets without bucket views, and those in shared memory, average in the
//     collective instead (11, 12).
//     With world size 1 and the built-in hook nothing is copied at all.
//  7. Outside a synchronized iteration (no_sync, forward under NoGradGuard) hooks do nothing:
//     gradients simply accumulate in .grad, and the next synchronized backward reduces the sum.
//  8. A forward that starts while a synchronized backward was begun but not finished fails
//     (PyTorch's "Expected to have finished reduction in the prior iteration").
//  9. Under tdist::autograd's distributed backward the gradients live in the autograd context,
//     not in .grad: that engine runs the accumulators' post hooks (and the final callback) with
//     the context current as a LeafGradients (core/leaf_gradients.h). The first hook of
//     an iteration captures it, and marking (2) and the write-back (4) read and write the
//     gradient through it, so the optimizer stepping that context sees the averages. The
//     parameters that (5) marks at forward time are read from .grad (usually undefined: zeros).
// 10. Devices. A bucket takes its parameters' dtype and device (assign_buckets never mixes
//     devices in one bucket), and so do its views and the gradients written back. The divisor of
//     (6) is a 0-dim tensor on the bucket's device, made at construction: CUDA divides by a host
//     scalar by multiplying with its reciprocal, which for a world that is not a power of two can
//     differ from the quotient in the last bit. The rebuild order (6) and the used map (5) are
//     host tensors on every rank whatever the parameters' device, so a group that routes
//     collectives by device (cpu:ring,cuda:nccl) sends them over its CPU backend on every rank
//     alike. The Work of a CUDA collective has stream semantics (wait() makes the current stream
//     wait for it, without blocking the host): finalize runs on the streams that called backward
//     (the engine runs final callbacks there) and, after the futures completed, calls the
//     built-in allreduce's Work::wait() for every bucket not on the CPU, so the write-back and
//     the optimizer see the reduced buckets. A registered comm hook returns only a future: for a
//     CUDA bucket its completion must mean that its value is ready for the current stream.
// 11. In place. With the built-in hook, a CPU bucket, no bucket views and no shared memory (12), a
//     gradient that a rank used and that is dense, contiguous and of the bucket's dtype and shape
//     (the usual .grad) is not copied: the bucket is reduced as allreduce_coalesced of its targets,
//     per slot the gradient itself or (for any other gradient, and for a parameter marked unused)
//     the view it was copied into, and the write-back skips the gradients reduced where they lie:
//     neither the copy in nor the copy back out (11.6 MB each per step of the MLP in docs/perf.md,
//     on the core that computes). Float and double buckets are not divided first (6) but reduced
//     with AVG: the rank that completes a segment's sum divides it while it is in its cache,
//     instead of a pass over every gradient; float16 and bfloat16 gradients are divided in place
//     first, for (6)'s overflow. The collective's plan depends only on the slots' sizes (Note
//     [Coalesced allreduce in place] in comm/ring/ring_process_group_ops.cpp), so ranks whose
//     gradients differ in layout agree. Unlike the copying path, a backward that fails after a
//     gradient was marked may leave that .grad partly reduced (or, for float16, divided), as with
//     gradient_as_bucket_view.
// 12. Symmetric buckets. A CPU bucket's buffer is the group's symmetric memory (Note [Symmetric
//     memory] in comm/ring/symmetric_memory.cpp; plain memory where the group cannot share it):
//     every rank builds its buckets at the same points (construction, and the rebuild of 6
//     after rank 0's broadcast), so the collective allocation lines up, and every rank gets
//     shared memory or none. With the built-in hook such a bucket is handled as with
//     gradient_as_bucket_view (its gradients become its views; a gradient that is a new tensor,
//     at the first backward or after zero_grad(set_to_none), is copied in once) and reduced as
//     one allreduce with AVG, which reads the peers' buckets where they lie (Note [Mapped
//     allreduce]): cheaper than 11's ring over each gradient where they lie (docs/perf.md). A
//     comm hook's allreduce of buffer() reads them in place too. TDIST_SINGLE_COPY=0 (no
//     shared memory) keeps 11.
//
// Thread safety: the engine calls hooks on the thread running backward (or several, one per
// device); all state is guarded by mu_, which is never held while a comm hook runs, a collective
// is issued or finalize waits. The introspection methods may be called from any thread, comm
// hooks included. prepare_* and the destructor must not run concurrently with a backward of
// this model.
// Blocking: finalize blocks until every bucket's communication finished or `timeout` passed.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tdist/ddp/bucket.h"
#include "tdist/ddp/comm_hooks.h"
#include "tdist/ddp/options.h"
#include "tdist/ddp/trace.h"

namespace torch::autograd {
struct Node;
}

namespace tdist::comm {
class ProcessGroup;
}
namespace tdist {
class LeafGradients;
}

namespace tdist::ddp {

class Reducer {
 public:
  // `params` must require grad and match across ranks (DistributedDataParallel checks it).
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
          std::shared_ptr<comm::ProcessGroup> pg, DDPOptions opts,
          std::shared_ptr<Trace> trace = nullptr);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Replaces the comm hook (default: allreduce_hook()). Only between iterations.
  void register_comm_hook(CommHook hook);

  // Before a forward whose backward will sync: checks the previous iteration finished and
  // rebuilds the buckets once (a collective: every rank calls it at the same point).
  void prepare_for_forward();
  // After that forward: arms the hooks for the coming backward and, with find_unused_parameters
  // (or static_graph), marks the parameters that `outputs` do not reach. `outputs_known` is false
  // when forward's result type holds tensors DDP cannot see (then unused parameters cannot be
  // found, which is an error under find_unused_parameters).
  void prepare_for_backward(const std::vector<at::Tensor>& outputs, bool outputs_known = true);

  // Introspection (tests, logging).
  std::vector<std::vector<size_t>> bucket_indices() const;
  size_t num_buckets() const;
  bool buckets_rebuilt() const;
  const std::vector<std::string>& names() const { return names_; }

 private:
  struct Hook;
  void autograd_hook(size_t index);
  void mark_ready(size_t index, bool used);
  void launch_ready(std::unique_lock<std::mutex>& lock);
  // The built-in allreduce's Work of a bucket not on the CPU goes to *work (else it stays null).
  // `targets` not empty: the built-in hook's tensors, reduced in place and averaged by the
  // collective if `average` (Note [DDP bucketing] 11).
  std::shared_ptr<comm::Future> launch_bucket(size_t b, GradBucket& view, bool builtin,
                                              std::vector<at::Tensor> targets, bool average,
                                              std::shared_ptr<comm::Work>* work);
  std::shared_ptr<comm::Future> launch_used_map(const at::Tensor& used);
  void finalize();
  void write_back(const std::vector<bool>& global_unused);
  bool passthrough() const;
  // Note [DDP bucketing] 11: whether the bucket is reduced as its targets, and whether a
  // gradient can be one.
  bool reduce_in_place(const Bucket& bucket) const;
  // Whether the bucket's gradients are its views: gradient_as_bucket_view, or Note 12.
  bool as_views(const Bucket& bucket) const;
  // ... and, for float and double, averaged by the collective (AVG) rather than divided first.
  bool averaged_by_collective(const Bucket& bucket) const;
  static bool reducible_in_place(const at::Tensor& grad, const at::Tensor& view);
  // The world size as a 0-dim double tensor on `device` (Note [DDP bucketing] 10).
  const at::Tensor& world_divisor(const at::Device& device) const;
  void add_trace(size_t b);
  void build_buckets(const std::vector<size_t>& order);
  void rebuild_buckets();
  void reset_iteration();
  std::vector<size_t> find_unreached(const std::vector<at::Tensor>& outputs) const;
  std::string describe(const std::vector<size_t>& indices) const;
  std::chrono::milliseconds wait_timeout() const;

  // Constant after construction:
  const std::vector<at::Tensor> params_;
  const std::vector<std::string> names_;
  const std::shared_ptr<comm::ProcessGroup> pg_;
  const DDPOptions opts_;
  const std::shared_ptr<Trace> trace_;
  // world_divisor() of each device that holds a parameter.
  std::vector<std::pair<at::Device, at::Tensor>> divisors_;
  // The gradient accumulators (the parameters hold them weakly; the hooks live on them).
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;

  mutable std::mutex mu_;
  std::condition_variable launch_cv_;  // launching_ became false
  // guarded by mu_:
  CommHook hook_;  // null: the built-in allreduce (see default_hook_)
  // No hook registered: divide by the world size while copying into the bucket, then
  // allreduce(SUM) (Note [DDP bucketing] 6). With world size 1 there is nothing to average:
  // gradients stay where autograd put them (no copies).
  bool default_hook_ = true;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> locate_;  // param -> (bucket, slot)
  bool expect_hooks_ = false;                      // a synchronized backward is armed
  bool backward_started_ = false;                  // a hook ran (finalize queued) in this iteration
  bool reduction_started_ = false;                 // something was marked in this iteration
  std::vector<bool> marked_;                       // per param, this iteration
  std::vector<int32_t> used_;  // per param, 1 if it got a gradient this iteration
  size_t next_launch_ = 0;
  bool launching_ = false;                     // a thread is launching (Note [DDP bucketing] 3)
  bool track_used_ = false;                    // this iteration allreduces the used map
  at::Tensor used_map_;                        // this iteration's used map, once launched
  std::shared_ptr<comm::Future> used_future_;  // its allreduce
  // Where this iteration's gradients live (Note [DDP bucketing] 9); null: .grad.
  std::shared_ptr<tdist::LeafGradients> leaf_grads_;
  std::vector<size_t> static_unused_;       // static_graph: unused locally (from iteration 1)
  std::vector<bool> static_global_unused_;  // static_graph: unused on every rank
  bool static_known_ = false;
  // Rebuild (Note [DDP bucketing] 6):
  bool rebuilt_ = false;
  bool record_order_ = true;
  std::vector<size_t> ready_order_;
  int64_t backward_begin_us_ = 0;
};

}  // namespace tdist::ddp
