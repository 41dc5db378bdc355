#pragma once
// ZeroRedundancyOptimizer: PyTorch's ZeRO-1 for DDP users. The optimizer state is sharded; the
// parameters and gradients stay whole on every rank (DDP averages the gradients as usual).
//
//   tdist::ddp::DistributedDataParallel<Net> model(net, pg);
//   tdist::fsdp::ZeroRedundancyOptimizer opt(
//       model.parameters(),
//       [](std::vector<at::Tensor> p) {
//         return std::make_unique<torch::optim::Adam>(std::move(p),
//                                                     torch::optim::AdamOptions(1e-3));
//       },
//       pg);
//   for (...) {
//     opt.zero_grad();
//     loss(model(x), y).backward();   // DDP's allreduce: every rank has the averaged gradients
//     opt.step();                     // steps this rank's partition, then broadcasts it
//   }
//
// It lives in fsdp/ (namespace tdist::fsdp), not in optim/: optim/ is the RPC side
// (DistributedOptimizer over RRefs, on rpc and autograd), while ZeRO-1 needs only a process
// group, as fully_shard does, and is the first of the sharding stages fsdp/ implements (ZeRO-2
// and -3 are fully_shard with reshard_after_forward off and on). A DDP user links tdist::fsdp
// without pulling in RPC.
//
// Note [ZeRO-1]
// ~~~~~~~~~~~~~
//  1. Partition: every rank sorts the parameters by numel (largest first, the earlier one on a
//     tie) and gives each in turn to the rank holding the fewest elements so far (the lower rank
//     on a tie): PyTorch's greedy balance. Every rank computes the same partition from the same
//     shapes; construction checks that the ranks passed the same count and shapes.
//  2. Each rank builds its local optimizer with the factory over its own parameters only, so the
//     optimizer's state (Adam: 2 tensors per parameter) exists for 1/N of the model per rank.
//  3. step(): the local optimizer steps the owned parameters with their (already averaged)
//     gradients. Then, for each owner r in rank order, the owner copies its parameters into one
//     flat buffer and broadcasts it from r (one broadcast per owner: coalesced); the others copy
//     the buffer back into their parameters. Broadcast r + 1 is issued before broadcast r is
//     waited for, so at most two owners' buffers exist at once (the memory of two partitions).
//     After step() every rank holds the same parameters, equal to what the unchanged optimizer
//     would have computed on every rank (the update is elementwise per parameter).
//  4. Every rank calls step() and zero_grad() alike (step() is a collective). A rank that owns
//     no parameter (more ranks than parameters) still takes part in every broadcast.
//  5. Checkpoints (PyTorch's consolidate_state_dict and load_state_dict): a checkpoint holds
//     the whole optimizer, as DDP's does, so it loads at any world size. consolidate_state_dict
//     serializes each rank's local optimizer (libtorch's own format), gathers the bytes to one
//     rank, which rebuilds each rank's local optimizer with the factory over that rank's
//     partition, loads the bytes into it and moves its per-parameter state into `full`, an
//     optimizer of the same kind over parameters() that the caller then saves. load_state_dict
//     takes from such a `full` optimizer (loaded from the checkpoint, at any world size) the
//     state of the parameters this rank owns now, and nothing else.
// Memory per rank for Ψ parameter elements, fp32 Adam: 4Ψ parameters + 4Ψ gradients + 8Ψ/N
// state, plus at most two partitions' flat copies during step(); consolidate_state_dict holds
// the whole state (8Ψ) on the receiving rank, plus every rank's serialized state.
//
// Thread safety: none (one thread drives it, as with a libtorch optimizer). Blocking:
// construction (one small allreduce pair) and step() wait for every rank, each collective
// bounded by options.timeout (else the group's).

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

namespace torch::optim {
class Optimizer;
}
namespace tdist::comm {
class ProcessGroup;
}

namespace tdist::fsdp {

struct ZeroRedundancyOptimizerOptions {
  // How long construction's check and each broadcast of step() may take before it fails with
  // TimeoutError; negative: the process group's own timeout.
  std::chrono::milliseconds timeout{-1};
};

class ZeroRedundancyOptimizer {
 public:
  // Builds the local optimizer over the parameters this rank owns.
  using OptimizerFactory =
      std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

  // A collective (Note [ZeRO-1] 1). `params`: the model's parameters in the same order on every
  // rank, all floating point, of one dtype and on one device, none twice. InvalidArgument for
  // bad parameters, a null factory or group, or ranks that passed different shapes.
  ZeroRedundancyOptimizer(std::vector<at::Tensor> params, OptimizerFactory factory,
                          std::shared_ptr<comm::ProcessGroup> pg,
                          ZeroRedundancyOptimizerOptions opts = {});
  ~ZeroRedundancyOptimizer();
  ZeroRedundancyOptimizer(const ZeroRedundancyOptimizer&) = delete;
  ZeroRedundancyOptimizer& operator=(const ZeroRedundancyOptimizer&) = delete;

  // A collective: steps the local partition, then broadcasts every partition from its owner
  // (Note [ZeRO-1] 3).
  void step();
  // Every parameter's gradient (not only the owned ones): set to none, or zeroed in place.
  void zero_grad(bool set_to_none = true);

  // The rank that owns params[i] (its optimizer state lives there).
  int owner(size_t i) const { return owner_.at(i); }
  const std::vector<at::Tensor>& parameters() const { return params_; }
  // This rank's parameters, in the order given.
  std::vector<at::Tensor> local_parameters() const;
  // Elements of the parameters each rank owns.
  const std::vector<int64_t>& partition_numel() const { return partition_numel_; }
  // The local optimizer; null when this rank owns no parameter.
  torch::optim::Optimizer* local_optimizer() { return local_.get(); }
  const torch::optim::Optimizer* local_optimizer() const { return local_.get(); }
  // Bytes of optimizer state this rank holds, measured from the state's tensors.
  size_t local_state_bytes() const;

  // A collective (Note [ZeRO-1] 5): every rank's optimizer state goes to rank `to`, where it is
  // written into `full`: an optimizer made by the same factory over parameters() (all of them,
  // in order); `full` is ignored (may be null) on the other ranks. Its state for every
  // parameter that has one is replaced. InvalidArgument for `to` outside the group, or on rank
  // `to` for a null `full` or one over other parameters; Error when a rank's state does not
  // load into an optimizer the factory makes.
  void consolidate_state_dict(torch::optim::Optimizer* full, int to = 0);
  // Local (Note [ZeRO-1] 5): the state of the parameters this rank owns, from `full`, an
  // optimizer over parameters() (e.g. one consolidate_state_dict filled, saved and loaded at
  // any world size). Parameters without state in `full` get none. InvalidArgument when `full`
  // is over other parameters or holds another kind of state than the local optimizer's.
  void load_state_dict(const torch::optim::Optimizer& full);

 private:
  // Constant after construction:
  std::vector<at::Tensor> params_;
  std::shared_ptr<comm::ProcessGroup> pg_;
  ZeroRedundancyOptimizerOptions opts_;
  std::vector<int> owner_;                  // per parameter
  std::vector<std::vector<size_t>> owned_;  // per rank: indices into params_, in order
  std::vector<int64_t> partition_numel_;    // per rank
  OptimizerFactory factory_;
  std::unique_ptr<torch::optim::Optimizer> local_;
};

// Bytes of the state tensors of a libtorch optimizer (Adam, AdamW, SGD, RMSprop, Adagrad; each
// storage counted once), measured from the tensors. InvalidArgument for a state of another type.
size_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

}  // namespace tdist::fsdp
