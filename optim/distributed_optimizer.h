#pragma once
// DistributedOptimizer (torch.distributed.optim.DistributedOptimizer, in C++): updates
// parameters that live on any worker, behind RRefs, with the gradients of a distributed autograd
// context.
//
//   std::vector<rpc::RRef<at::Tensor>> params = net.rpc_sync<...>("parameter_rrefs");
//   optim::DistributedOptimizer opt(
//       optim::OptimizerSpec::sgd(torch::optim::SGDOptions(0.05)), params);
//   for (...) {
//     autograd::Context ctx;
//     ... forward over RPC ...; autograd::backward(ctx.id(), {loss});
//     opt.step(ctx.id());
//   }
//
// The constructor creates one LocalOptimizer per owner (a remote call), holding that owner's
// parameters, and waits until all exist (Error naming the owner otherwise). step(ctx) asks every
// owner at once to apply its part of the context's gradients (parameters without a gradient in
// the context are left as they are) and returns when all have; steps of several trainers on one
// owner run one after another there. A failing or unreachable owner fails step with an Error
// naming it (the other owners' updates stand). Thread safety: one DistributedOptimizer may be
// used from one thread at a time; several (one per trainer) may share parameters.

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

#include "tdist/optim/detail/local_optimizer.h"
#include "tdist/optim/optimizer_spec.h"
#include "tdist/rpc/rref.h"

namespace torch::nn {
class Module;
}

namespace tdist::optim {

// An RRef (owned here) to each parameter of `module`, in parameters() order: what a worker that
// holds a model hands to a DistributedOptimizer elsewhere (PyTorch's [RRef(p) for p in
// model.parameters()]).
std::vector<rpc::RRef<at::Tensor>> parameter_rrefs(const torch::nn::Module& module);

class DistributedOptimizer {
 public:
  DistributedOptimizer(OptimizerSpec spec, std::vector<rpc::RRef<at::Tensor>> params);

  void step(int64_t context_id);

  // Each owner's optimizer state, by owner name (for checkpoints), and its reverse
  // (InvalidArgument for an owner this optimizer does not have).
  std::map<std::string, std::string> state_dict();
  void load_state_dict(const std::map<std::string, std::string>& state);

  const OptimizerSpec& spec() const { return spec_; }
  // Names of the owners, in the order their parameters first appear.
  std::vector<std::string> owners() const;

 private:
  OptimizerSpec spec_;
  std::vector<std::pair<std::string, rpc::RRef<detail::LocalOptimizer>>> remotes_;
};

}  // namespace tdist::optim
