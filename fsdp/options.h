#pragma once
// Options of fully_shard, named as PyTorch's FSDP2 names them where it has the option.

#include <chrono>

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
};

}  // namespace tdist::fsdp
