#pragma once
// FSDPState: the non-template part of FullyShardedModule (tdist/fsdp/fully_shard.h): the units'
// ParamGroups, the forward and backward steps of Note [Sharded data parallel], and the registry
// through which fsdp::call finds the unit a module belongs to.
//
// Thread safety: one thread drives a model's forwards (as with any module); the autograd engine
// calls the backward steps on the thread that runs that backward. The registry is thread safe.
// Ownership: the autograd nodes and hooks hold the state weakly; once it is gone they do nothing.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tdist/fsdp/options.h"

namespace torch::nn {
class Module;
}
namespace tdist::comm {
class DeviceMesh;
class ProcessGroup;
}  // namespace tdist::comm

namespace tdist::fsdp::detail {

class ParamGroup;

class FSDPState : public std::enable_shared_from_this<FSDPState> {
 public:
  // A collective (see fully_shard). Throws InvalidArgument on bad units (see fully_shard.h).
  // With opts.shard_size, lays `pg` out as a mesh {"replicate", "shard"} (HSDP).
  static std::shared_ptr<FSDPState> create(std::shared_ptr<torch::nn::Module> root,
                                           std::vector<std::shared_ptr<torch::nn::Module>> units,
                                           std::shared_ptr<comm::ProcessGroup> pg,
                                           FSDPOptions opts);
  // Shards along the mesh's "shard" dimension, replicates along its "replicate" one (if any).
  static std::shared_ptr<FSDPState> create(std::shared_ptr<torch::nn::Module> root,
                                           std::vector<std::shared_ptr<torch::nn::Module>> units,
                                           const comm::DeviceMesh& mesh, FSDPOptions opts);
  ~FSDPState();
  FSDPState(const FSDPState&) = delete;
  FSDPState& operator=(const FSDPState&) = delete;

  // The forward steps of group g (kRoot: the root's call, whether or not it has parameters).
  // pre_forward may replace `inputs` by aliases (the post-backward node); post_forward may
  // replace `outputs` (the pre-backward node). outputs_known: `outputs` holds every tensor of
  // the result (else the unit keeps its parameters gathered until its backward).
  static constexpr int kRoot = -1;
  void pre_forward(int g, std::vector<at::Tensor>& inputs);
  void post_forward(int g, std::vector<at::Tensor>& outputs, bool outputs_known);

  // The backward steps (called by the boundary nodes, the accumulator hooks and the engine's
  // final callback).
  void pre_backward(int g);
  void post_backward(int g);
  void on_grad_ready(int g);
  void finish_backward();

  // Note [Sharded data parallel] 5: off, backward keeps the units' full gradients in the
  // module parameters' .grad (accumulating) instead of reduce-scattering them.
  void set_require_sync(bool on) { require_sync_ = on; }
  bool require_sync() const { return require_sync_; }
  // A collective: the norm of all sharded gradients together; scales them by
  // max_norm / (norm + 1e-6) where that is below 1. Returns the norm.
  double clip_grad_norm(double max_norm, double norm_type);

  // Collectives issued so far by this rank (tests, logging).
  struct Counters {
    size_t allgathers = 0;  // of unit parameters, forward and backward
    size_t prefetched = 0;  // of those, issued ahead of the unit's use
    size_t reduce_scatters = 0;
    size_t replica_allreduces = 0;  // HSDP: of reduce-scatter results, across the replicas
  };
  const Counters& counters() const { return counters_; }

  std::vector<at::Tensor> parameters() const;
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  std::vector<std::pair<std::string, at::Tensor>> full_parameters() const;
  size_t unsharded_bytes() const;
  size_t num_groups() const { return groups_.size(); }
  const ParamGroup& group(size_t g) const { return *groups_.at(g); }
  // The group the shards are spread across, and (HSDP) the group of this rank's replicas, or
  // null.
  const std::shared_ptr<comm::ProcessGroup>& process_group() const { return pg_; }
  const std::shared_ptr<comm::ProcessGroup>& replicate_group() const { return replicate_pg_; }
  const FSDPOptions& options() const { return opts_; }

 private:
  struct GradHook;
  struct Step {                  // one group's progress through the current iteration
    bool forwarded = false;      // ran forward with autograd recording
    bool pre_backward = false;   // its pre-backward step ran
    bool post_backward = false;  // its gradients were sent to the reduce-scatter
    size_t grads_ready = 0;      // parameters whose gradient the engine accumulated
  };

  FSDPState(std::shared_ptr<torch::nn::Module> root, std::shared_ptr<comm::ProcessGroup> pg,
            std::shared_ptr<comm::ProcessGroup> replicate_pg, FSDPOptions opts);
  static std::shared_ptr<FSDPState> create_sharded(
      std::shared_ptr<torch::nn::Module> root,
      const std::vector<std::shared_ptr<torch::nn::Module>>& units,
      std::shared_ptr<comm::ProcessGroup> pg, std::shared_ptr<comm::ProcessGroup> replicate_pg,
      FSDPOptions opts);
  void build(const std::vector<std::shared_ptr<torch::nn::Module>>& units);
  void begin_iteration();
  void end_iteration();
  // Gathers group g (counted), waiting for it.
  void unshard(int g);
  // Issues the gathers of up to opts_.prefetch groups after (direction +1) or before (-1) g in
  // the previous step's forward order.
  void prefetch(int g, int direction);
  // HSDP: issues the replicas' allreduce of the groups in replicating_, in order, while their
  // reduce-scatter is complete (wait: waiting for each).
  void start_replica_reduces(bool wait);
  // Casts the floating-point inputs to options().param_dtype (cast_forward_inputs).
  void cast_inputs(std::vector<at::Tensor>& inputs) const;
  void ensure_final_callback();
  // Throws unless group g ran forward in this step (a backward step of an older graph).
  void check_forwarded(int g) const;
  std::chrono::milliseconds timeout() const;

  // Constant after construction:
  const std::shared_ptr<torch::nn::Module> root_;
  const std::shared_ptr<comm::ProcessGroup> pg_;            // the shard group
  const std::shared_ptr<comm::ProcessGroup> replicate_pg_;  // HSDP, else null
  const FSDPOptions opts_;
  std::vector<std::unique_ptr<ParamGroup>> groups_;  // units inner first, the root's last
  int root_group_ = -1;                              // index of the root's own group, or -1
  // The unit modules in the registry, each with its group (-1: it has no parameters).
  std::vector<std::pair<const torch::nn::Module*, int>> registered_;
  struct HookKey {
    size_t group;
    size_t index;  // into the group's accumulators
    uintptr_t key;
  };
  std::vector<HookKey> hook_keys_;

  // The current iteration (see the thread-safety note):
  std::vector<Step> steps_;
  std::vector<int> forward_order_;  // groups in the order their forwards ran
  bool callback_queued_ = false;
  // HSDP: groups whose reduce-scatter is issued and whose replicas' allreduce is not yet, in
  // issue order (Note [Sharded data parallel] 7).
  std::deque<int> replicating_;
  // The previous step's forward order and each group's place in it (-1: absent).
  std::vector<int> last_order_;
  std::vector<int> last_position_;
  bool require_sync_ = true;
  Counters counters_;
};

// The unit `module` belongs to, if a live FSDPState sharded it: {state, group}; {nullptr, -1}
// otherwise (also for a unit without parameters of its own).
std::pair<std::shared_ptr<FSDPState>, int> find_unit(const torch::nn::Module* module);

}  // namespace tdist::fsdp::detail
