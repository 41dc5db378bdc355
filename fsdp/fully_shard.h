#pragma once
// fully_shard: sharded data parallel training of a torch::nn::Module (PyTorch's FSDP2, in C++).
//
//   struct NetImpl : torch::nn::Module {
//     ...
//     torch::Tensor forward(torch::Tensor x) {
//       for (auto& block : blocks) x = tdist::fsdp::call(block, x);  // a unit boundary
//       return tdist::fsdp::call(head, x);
//     }
//   };
//   auto pg = tdist::comm::create_process_group("env://");
//   Net net;
//   auto model = tdist::fsdp::fully_shard(net, {net->blocks[0].ptr(), ..., net->head.ptr()}, pg);
//   torch::optim::Adam opt(model.parameters(), 1e-3);   // an unchanged optimizer, on the shards
//   for (...) {
//     opt.zero_grad();
//     torch::mse_loss(model(x), y).backward();   // gradients reduce-scattered (averaged) here
//     opt.step();
//   }
//
// libtorch's C++ modules have no forward hooks, so the boundary of a unit is explicit: the
// model's forward calls each unit as fsdp::call(unit, args...), which is a plain
// unit->forward(args...) for a module no live FullyShardedModule sharded (the same model code
// runs unsharded, under DDP or alone). Calling a sharded unit's forward directly fails: its
// parameters are empty outside its fsdp::call.
//
// Note [Sharded data parallel]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Units. fully_shard(root, units, pg) makes a group of parameters of each unit (a submodule of
// the root) and one of the root's remaining parameters (the root's group; none when every
// parameter is in a unit). A unit inside another unit takes its own parameters first; the
// outer one takes the rest (FSDP2 applies fully_shard bottom-up). A group's parameters are
// flattened into one buffer of P elements (their total rounded up to a multiple of the world
// size N) and rank r keeps elements [r*P/N, (r+1)*P/N) as one leaf tensor, the group's sharded
// parameter (detail/param_group.h). parameters() gives those to the optimizer: Adam's state is
// created for the shards, so parameters, gradients and optimizer state all take 1/N.
//
// A step, and the collectives of one group g, in this order on every rank:
//  1. Forward of the root: the root's group is gathered (one allgather_into_tensor) and kept to
//     its backward. For each unit in the order the model calls it, fsdp::call gathers the
//     unit's group, points the module's parameters at views of the gathered buffer, runs the
//     unit's forward, and (reshard_after_forward, the default) frees the buffer: the module
//     parameters become empty tensors again. Autograd keeps views of parameters it saved; they
//     share the buffer's storage, whose bytes are freed and later refilled in place.
//     Identity nodes go on the unit's inputs (post-backward) and outputs (pre-backward)
//     (detail/boundary.h).
//  2. Backward reaches a unit's outputs: its pre-backward node gathers the group again (unless
//     it was kept: reshard_after_forward=false, or outputs fsdp::call cannot see). The unit's
//     backward then runs with full parameters; autograd accumulates full-size gradients into the
//     module parameters' .grad.
//  3. As soon as the last of a group's gradients is accumulated (a post hook on each gradient
//     accumulator; or, when some parameter got no gradient this step, at the post-backward node
//     on the unit's inputs, or else at the end of backward), the gathered parameters are freed,
//     then the group's gradients are copied into one flat buffer (zeros for a missing one;
//     each full gradient freed once copied), divided by N, and reduce_scatter_tensor (SUM)
//     starts. The collective overlaps the backward of the units before it; the flat buffer is
//     dropped at the first backward step (2 or 3 of any group) that finds it complete.
//  4. End of backward (the engine's final callback): the post-backward step of every group that
//     ran forward and has not had it, in reverse forward order; then each reduce-scatter is
//     waited for and its result added to the sharded parameter's .grad; the root's group is
//     freed, and so is any prefetched group that went unused. The optimizer then steps on the
//     shards; the next forward gathers the new values.
//  5. Prefetch (options.prefetch = L, default 1): when a unit's forward begins, the allgathers of
//     the next L groups of the previous step's forward order are issued at once (Work, not
//     waited for): they run on the process group's thread while this unit computes, and the
//     next unit's gather (1) waits for its Work instead of issuing one. When a unit's backward
//     begins (2), the L groups before it in that order are prefetched the same way (backward
//     meets them next); when the root's group begins backward, which it does before any unit,
//     the last L groups of that order are. A group gathered or being gathered is not issued
//     again, so at most L groups are gathered ahead of the one running. The order is recorded
//     by every rank from the same calls, so ranks issue the same collectives in the same order;
//     the first step has no order and does not prefetch.
//  6. Gradient accumulation (no_sync()): while a NoSyncGuard lives, step 3 frees the gathered
//     parameters but neither reduce-scatters nor frees the full gradients: they stay in the
//     module parameters' .grad, and autograd adds the next backward's to them. The first
//     backward outside the guard reduce-scatters the sum. The sharded .grad is left untouched
//     meanwhile (no optimizer step belongs inside the guard).
//  7. HSDP (FSDPOptions::shard_size, or fully_shard over a comm::DeviceMesh with dimensions
//     "replicate" and "shard"): every collective of 1-6 runs in the rank's shard group, so a
//     group is padded to a multiple of the shard group's size S and each rank keeps P/S
//     elements; the R ranks of a replicate group (same place in their shard groups) keep the
//     same shard. Step 3 divides the flat gradient by R*S; as soon as its reduce-scatter has
//     completed, the result is allreduced (SUM) across the replicate group, into the buffer it
//     arrived in. Those allreduces are issued in the order of the reduce-scatters, from a
//     queue: after each later reduce-scatter is issued, the groups at the queue's head whose
//     reduce-scatter has completed get theirs; at the end of backward every one left, waiting
//     for each. So every rank issues them in one order whatever the timing, and those issued
//     early overlap the backward of the units before them. clip_grad_norm sums over the
//     shard group only (replicas hold equal gradients); sync_module_states broadcasts through
//     the replicate group, then the shard group (global rank 0 is rank 0 of both).
//  8. Mixed precision (param_dtype, reduce_dtype): the sharded parameter, its .grad and the
//     optimizer's state keep the model's dtype (the master copy). A gather casts the shard to
//     param_dtype and gathers that (half the bytes for bf16): the module parameters are
//     param_dtype views and the unit computes in param_dtype; with cast_forward_inputs each
//     forward's floating-point tensor arguments are cast too. The autograd engine casts each
//     full gradient back to the dtype its accumulator recorded (the model's: the accumulators
//     were created before sharding), so .grad and step 3's copy are in the model's dtype; the
//     flat gradient is then cast to reduce_dtype for the reduce-scatter (and the replicas'
//     allreduce), and the result cast back to the model's dtype before it is added to the
//     shard's .grad. The optimizer steps the fp32 master.
// Every rank must call the same units in the same order with autograd recording alike, and run
// one backward per forward of the root (accumulate gradients over several forward/backward
// pairs, under no_sync() but the last). A unit runs at most once per forward of the root.
//
// Memory on a rank, for a model of Ψ parameter elements and a shard group of N ranks (HSDP: N is
// the shard size), at rest: Ψ/N parameters + Ψ/N gradients + the optimizer's state of Ψ/N
// (Adam: 2Ψ/N), all in the model's dtype. Gathered groups and their flat gradients take
// param_dtype's and reduce_dtype's element sizes (the full .grad the model's). During forward:
// plus the root's group
// and one gathered unit (with reshard_after_forward; without it, every unit gathered so far).
// During backward: plus the root's group, the gathered unit and its full gradients; then, with
// the unit freed, its flat gradient until its reduce-scatter completes (those of earlier units
// still in flight too).
// Prefetch adds up to L gathered groups; no_sync() keeps the full gradients of every unit (Ψ)
// until the synchronizing backward. A forward without autograd recording frees every group,
// the root's too, after its forward. A parameter no unit's forward used gets a zero gradient,
// not none: a group's shard is one optimizer tensor (as with FSDP1's flat parameters; DDP leaves
// its .grad undefined, so an optimizer skips it there).
//
// Checkpoints: the flat layout above does not depend on N but for the padding, so a group's
// shards saved at one world size are byte ranges of what each rank needs at another
// (fsdp/checkpoint.h, Note [Sharded checkpoints]; consolidated safetensors files there too).
//
// Thread safety: one thread drives a FullyShardedModule (as with a module); the engine runs the
// backward steps on the thread it runs that backward on. Blocking: construction (broadcasts,
// when syncing), each gather and the end of backward wait for the other ranks, each bounded by
// the options' timeout (else the group's).

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tdist/fsdp/detail/forward.h"
#include "tdist/fsdp/detail/fsdp_state.h"
#include "tdist/fsdp/options.h"

namespace tdist::fsdp {

// The forward of a unit: module->forward(args...), between the gathering and the freeing of
// the unit's parameters when a live FullyShardedModule sharded `module` (a module holder or a
// shared_ptr to a module); a plain call otherwise. See the file comment.
template <typename M, typename... Args>
auto call(M& module, Args&&... args) {
  auto [state, g] = detail::find_unit(static_cast<const torch::nn::Module*>(module.get()));
  if (state == nullptr || g < 0) return module->forward(std::forward<Args>(args)...);
  return detail::run_unit(
      *state, g, [&](auto&&... in) { return module->forward(std::forward<decltype(in)>(in)...); },
      std::forward<Args>(args)...);
}

// While alive, backwards of `model` keep their full gradients instead of reduce-scattering them
// (PyTorch's no_sync(); Note [Sharded data parallel] 6).
class NoSyncGuard {
 public:
  explicit NoSyncGuard(detail::FSDPState& state) : state_(&state), previous_(state.require_sync()) {
    state_->set_require_sync(false);
  }
  ~NoSyncGuard() {
    if (state_) state_->set_require_sync(previous_);
  }
  NoSyncGuard(NoSyncGuard&& o) noexcept : state_(o.state_), previous_(o.previous_) {
    o.state_ = nullptr;
  }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;

 private:
  detail::FSDPState* state_;
  bool previous_;
};

// The root module with its units sharded (see the file comment and the Note). ModuleType: a
// module holder (TORCH_MODULE(Net), ...) or a std::shared_ptr to a torch::nn::Module subclass.
template <typename ModuleType>
class FullyShardedModule {
 public:
  FullyShardedModule(ModuleType module, std::vector<std::shared_ptr<torch::nn::Module>> units,
                     std::shared_ptr<comm::ProcessGroup> pg, FSDPOptions opts = {})
      : module_(std::move(module)),
        state_(detail::FSDPState::create(detail::module_ptr(module_), std::move(units),
                                         std::move(pg), opts)) {}
  FullyShardedModule(ModuleType module, std::vector<std::shared_ptr<torch::nn::Module>> units,
                     const comm::DeviceMesh& mesh, FSDPOptions opts = {})
      : module_(std::move(module)),
        state_(
            detail::FSDPState::create(detail::module_ptr(module_), std::move(units), mesh, opts)) {}

  // Calls module->forward(args...) as the root's forward and returns its result.
  template <typename... Args>
  auto forward(Args&&... args) {
    return detail::run_unit(
        *state_, detail::FSDPState::kRoot,
        [&](auto&&... in) { return module_->forward(std::forward<decltype(in)>(in)...); },
        std::forward<Args>(args)...);
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // The sharded parameters, one flat shard per group (units inner first, the root's last):
  // give these to the optimizer.
  std::vector<at::Tensor> parameters() const { return state_->parameters(); }
  // The same, each named after its unit ("blocks.0", ...; "(root)" for the root's group).
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const {
    return state_->named_parameters();
  }
  // A collective: the full value of every parameter of the module, named and ordered as
  // module->named_parameters() (fresh tensors; e.g. to compare or to save).
  std::vector<std::pair<std::string, at::Tensor>> full_parameters() const {
    return state_->full_parameters();
  }
  // Bytes of gathered parameters this rank holds now (0 between steps).
  size_t unsharded_bytes() const { return state_->unsharded_bytes(); }

  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*state_); }
  // A collective (torch::nn::utils::clip_grad_norm_ over the whole model): the norm of all
  // ranks' sharded gradients together; every rank scales its shards' gradients by
  // max_norm / (norm + 1e-6) where that is below 1. Returns the norm. norm_type: p > 0 or
  // infinity.
  double clip_grad_norm(double max_norm, double norm_type = 2.0) {
    return state_->clip_grad_norm(max_norm, norm_type);
  }
  // Collectives this rank issued so far (tests, logging).
  const detail::FSDPState::Counters& counters() const { return state_->counters(); }

  ModuleType& module() { return module_; }
  const ModuleType& module() const { return module_; }
  void train(bool on = true) { module_->train(on); }
  void eval() { module_->eval(); }
  // The group the shards are spread across (HSDP: this rank's shard group).
  const std::shared_ptr<comm::ProcessGroup>& process_group() const {
    return state_->process_group();
  }
  // HSDP: the group of the ranks that hold the same shards as this one; null without replicas.
  const std::shared_ptr<comm::ProcessGroup>& replicate_group() const {
    return state_->replicate_group();
  }
  const FSDPOptions& options() const { return state_->options(); }
  detail::FSDPState& state() { return *state_; }

 private:
  ModuleType module_;
  std::shared_ptr<detail::FSDPState> state_;
};

// Shards `root`'s units and its remaining parameters across `pg` (a collective: every rank
// calls it with the same model structure). Bad units (null, the root itself, not a submodule
// of the root, listed twice, already sharded, sharing a parameter with another unit) and
// unsupported parameters (frozen, not floating point, one unit's on two dtypes or devices)
// throw InvalidArgument, as do a shard_size that does not divide the group's size and a
// param_dtype or reduce_dtype that is not floating point. With a shard_size (HSDP) it lays `pg`
// out as a comm::DeviceMesh {"replicate", size / shard_size}, {"shard", shard_size} first.
template <typename ModuleType>
FullyShardedModule<ModuleType> fully_shard(ModuleType root,
                                           std::vector<std::shared_ptr<torch::nn::Module>> units,
                                           std::shared_ptr<comm::ProcessGroup> pg,
                                           FSDPOptions opts = {}) {
  return FullyShardedModule<ModuleType>(std::move(root), std::move(units), std::move(pg), opts);
}

// The same over a mesh (a collective over its world): shards across the mesh's "shard"
// dimension and, where it has one, replicates across its "replicate" dimension (HSDP; Note
// [Sharded data parallel] 7); other dimensions (e.g. "pp") are left to their owners. A mesh
// without a "shard" dimension, or opts.shard_size other than 0 or the shard dimension's size,
// throws InvalidArgument.
template <typename ModuleType>
FullyShardedModule<ModuleType> fully_shard(ModuleType root,
                                           std::vector<std::shared_ptr<torch::nn::Module>> units,
                                           const comm::DeviceMesh& mesh, FSDPOptions opts = {}) {
  return FullyShardedModule<ModuleType>(std::move(root), std::move(units), mesh, opts);
}

}  // namespace tdist::fsdp
