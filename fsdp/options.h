#pragma once
// Options of fully_shard, named as PyTorch's FSDP2 names them where it has the option.

#include <c10/core/ScalarType.h>

#include <chrono>
#include <optional>

namespace tdist::fsdp {

struct FSDPOptions {
  // Free each unit's gathered parameters after its forward and gather them again before its
  // backward (FSDP2's default). false keeps them from forward to the end of the unit's backward:
  // one allgather per unit and step instead of two, for the memory of the unsharded unit
  // (ZeRO-2's trade). The root's own parameters are always kept to its backward (FSDP2 does the
  // same: the root's backward comes first).
  bool reshard_after_forward = true;
  // How many units ahead of the one running have their allgather issued (asynchronously: it
  // runs on the group's thread while this one computes): in forward the units that follow in the
  // previous step's forward order, in backward those that precede (backward runs it in
  // reverse). The bound on units gathered ahead at once; 0 gathers each unit only when it runs.
  // The first step, with no order recorded yet, does not prefetch.
  int prefetch = 1;
  // Broadcast rank 0's parameters and buffers before sharding (FSDP1's sync_module_states), so
  // ranks need not initialise their models alike. false: every rank must hold the same values.
  bool sync_module_states = true;
  // How long an allgather, reduce-scatter or the construction's broadcast may take before the
  // step fails with TimeoutError; negative: the process group's own timeout.
  std::chrono::milliseconds timeout{-1};

  // HSDP (hybrid sharding): shard each unit inside groups of `shard_size` consecutive ranks of
  // the process group and replicate across those groups: gradients are reduce-scattered in the
  // shard group, then allreduced across the replicas (Note [Sharded data parallel] 7). The group
  // is laid out as a comm::DeviceMesh {"replicate", size / shard_size}, {"shard", shard_size}.
  // 0 (or the group's size): shard across the whole group. Must divide the group's size.
  // fully_shard over a DeviceMesh takes the sizes from the mesh instead (leave this 0).
  int shard_size = 0;

  // Mixed precision (PyTorch's MixedPrecisionPolicy; Note [Sharded data parallel] 8). The
  // sharded master copy, its gradient and the optimizer's state keep the parameters' own dtype.
  // param_dtype: the dtype the parameters are gathered in and the units compute in (e.g.
  // at::kBFloat16); unset: the parameters' own.
  std::optional<c10::ScalarType> param_dtype;
  // The dtype the gradients are reduce-scattered (and allreduced across replicas) in; unset:
  // the parameters' own (fp32 for an fp32 model). PyTorch's FSDP2 reduces in param_dtype when
  // this is unset; tdist keeps the full-precision reduction unless asked.
  std::optional<c10::ScalarType> reduce_dtype;
  // With param_dtype: the floating-point tensor arguments of the root's and each unit's forward
  // are cast to param_dtype (FSDP2's cast_forward_inputs). The result keeps the units' dtype.
  bool cast_forward_inputs = true;
};

}  // namespace tdist::fsdp
