#pragma once
// ParamGroup: the parameters of one FSDP unit, flattened into one buffer and sharded along it
// (FSDP2's FSDPParamGroup; Note [Sharded data parallel] in tdist/fsdp/fully_shard.h).
//
// Layout: the unit's parameters, in order, back to back in a flat buffer of `padded_numel()`
// elements (their total rounded up to a multiple of the shard group's size; the tail is zero).
// Rank r of the shard group holds elements [r * S, (r + 1) * S) with S = padded_numel() / size
// as `sharded_param()`: a leaf that requires grad, in the parameters' own dtype, the tensor the
// optimizer steps. Gathered, the flat buffer is `full_` (in the compute dtype: param_dtype when
// set) and each module parameter's data is a view into it; resharded, `full_`'s storage holds
// no bytes and each module parameter's data is an empty tensor. With replicas (HSDP) every rank
// of a replicate group holds the same shard.
//
// Why the storage is resized rather than replaced: autograd keeps views of the parameters that
// forward saved (a Linear saves weight.t()). Those views share full_'s storage object, so
// emptying that storage frees the memory while they live, and gathering into the same storage
// before backward makes them see the parameters again.
//
// Thread safety: none. FSDPState drives a group from the thread that runs forward and from the
// thread the autograd engine runs its backward on, never both at once.
// Blocking: the constructor (a broadcast, when syncing), unshard, reshard (a prefetch in
// flight) and finish_reduce wait for their collectives, each issued with `timeout` as its own
// deadline; they wait with Work::wait() (bounded by that deadline), which lets the ring backend
// run an operation on the waiting thread when nothing is ahead of it.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch::autograd {
struct Node;
}
namespace tdist::comm {
class ProcessGroup;
class Work;
}  // namespace tdist::comm

namespace tdist::fsdp::detail {

// How a group is sharded and reduced (the same for every group of a model).
struct ShardingConfig {
  std::shared_ptr<comm::ProcessGroup> shard_pg;      // the shards are spread across it
  std::shared_ptr<comm::ProcessGroup> replicate_pg;  // HSDP: the replicas of this shard; or null
  std::chrono::milliseconds timeout{-1};             // of every collective
  bool sync = true;  // broadcast global rank 0's values (through replicate_pg, then shard_pg)
  std::optional<c10::ScalarType> param_dtype;   // the gathered parameters' dtype
  std::optional<c10::ScalarType> reduce_dtype;  // the gradients' dtype in the collectives
};

class ParamGroup {
 public:
  // `params`: leaves that require grad, one dtype and device, distinct, the same on every rank
  // (their values too unless `config.sync`). A collective: every rank builds its groups in one
  // order. Takes the parameters' values: afterwards they are empty until unshard().
  ParamGroup(std::string name, std::vector<at::Tensor> params, std::vector<std::string> names,
             const ShardingConfig& config);
  ~ParamGroup();
  ParamGroup(const ParamGroup&) = delete;
  ParamGroup& operator=(const ParamGroup&) = delete;

  const std::string& name() const { return name_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  const std::vector<std::string>& param_names() const { return names_; }
  // The gradient accumulators of params(), created while the parameters had their full shapes
  // (the engine checks a gradient against the shape its accumulator recorded).
  const std::vector<std::shared_ptr<torch::autograd::Node>>& accumulators() const {
    return accumulators_;
  }
  // Each parameter's full shape and its first element in the flat buffer (checkpoints).
  const std::vector<std::vector<int64_t>>& shapes() const { return shapes_; }
  const std::vector<int64_t>& offsets() const { return offsets_; }
  const at::Tensor& sharded_param() const { return shard_; }
  int64_t numel() const { return total_numel_; }
  int64_t padded_numel() const { return padded_numel_; }
  bool unsharded() const { return unsharded_; }
  // Bytes the gathered buffer holds now (0 when resharded).
  size_t unsharded_bytes() const;

  // Starts gathering the unit's parameters (one allgather_into_tensor into the buffer); returns
  // false (and does nothing) when they are gathered or being gathered. A prefetch.
  bool start_unshard();
  bool unshard_pending() const { return ag_work_ != nullptr; }
  // Gathers the unit's parameters (or waits for the gather start_unshard began) and points each
  // module parameter at its view of them. No-op when already gathered.
  void unshard();
  // Frees the gathered buffer (after waiting for a gather in flight into it); the module
  // parameters become empty. No-op when resharded.
  void reshard();
  // Starts the reduce-scatter of the module parameters' gradients (a missing one counts as
  // zeros; in the reduce dtype), each divided by the number of ranks holding a shard or replica
  // first (the average, as DDP computes it), and frees them (their .grad becomes undefined).
  // Must be followed by finish_reduce().
  void reduce_grads();
  // HSDP: whether the reduce-scatter's result still has to be allreduced across the replicas.
  bool replica_reduce_due() const { return rs_work_ != nullptr && replicate_pg_ && !ar_work_; }
  // HSDP: issues the allreduce across the replicas of the reduce-scatter's result once that is
  // complete; `wait`: waits for it to complete first, else returns false while it is not.
  // Callers issue these in the order of reduce_grads() on every rank (the collectives' order).
  bool start_replica_reduce(bool wait);
  // Waits for reduce_grads()'s collectives (issuing the replicas' allreduce where it is still
  // due) and adds the result, in the parameters' dtype, to sharded_param()'s .grad (or makes it
  // the .grad where there was none). No-op when none is pending.
  void finish_reduce();
  bool reduce_pending() const { return rs_work_ != nullptr; }
  // Drops this group's hold on the reduce-scatter's input (the flat gradient) once that
  // collective has completed, so the buffer need not live to finish_reduce(). Non-blocking.
  void release_reduce_input();
  // Drops a pending reduce-scatter without waiting (after a failed backward).
  void drop_reduce();

  // A collective: the full value of each parameter (fresh tensors, in params() order).
  std::vector<at::Tensor> gather_full() const;

 private:
  at::TensorOptions options() const;

  // Constant after construction:
  at::TensorOptions compute_options() const;  // of the gathered buffer
  at::TensorOptions reduce_options() const;   // of the gradients' collectives

  const std::string name_;
  const std::vector<at::Tensor> params_;
  const std::vector<std::string> names_;
  const std::shared_ptr<comm::ProcessGroup> pg_;            // the shard group
  const std::shared_ptr<comm::ProcessGroup> replicate_pg_;  // null: no replicas (or one)
  const std::chrono::milliseconds timeout_;
  const c10::ScalarType param_dtype_;   // of the gathered buffer
  const c10::ScalarType reduce_dtype_;  // of rs_input_ and rs_output_
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<int64_t> offsets_;
  std::vector<int64_t> numels_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  int64_t total_numel_ = 0;
  int64_t padded_numel_ = 0;
  int64_t shard_numel_ = 0;
  at::Tensor shard_;  // the leaf the optimizer steps (its data is updated in place)
  at::Tensor full_;   // padded_numel_ elements; its storage is emptied while resharded
  at::Tensor empty_;  // what a resharded parameter's data is

  bool unsharded_ = false;
  std::shared_ptr<comm::Work> ag_work_;  // the gather in flight into full_ (start_unshard)
  at::Tensor ag_input_;                  // its input: the shard cast to param_dtype_
  // The reduce-scatter in flight (reduce_grads .. finish_reduce), the replicas' allreduce of
  // its output (HSDP; start_replica_reduce .. finish_reduce) and their buffers.
  std::shared_ptr<comm::Work> rs_work_;
  std::shared_ptr<comm::Work> ar_work_;
  at::Tensor rs_input_;
  at::Tensor rs_output_;
};

}  // namespace tdist::fsdp::detail
