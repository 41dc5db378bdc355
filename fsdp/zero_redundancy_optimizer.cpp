#include "tdist/fsdp/zero_redundancy_optimizer.h"

#include <ATen/ATen.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>
#include <typeinfo>
#include <unordered_set>

#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"

namespace tdist::fsdp {
namespace {

void count_storage(const at::Tensor& t, std::unordered_set<const void*>& seen, size_t& bytes) {
  if (!t.defined()) return;
  const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (seen.insert(s).second) bytes += s->nbytes();
}

// Checks that `full` is an optimizer over exactly `params`, in order.
void check_full_optimizer(const torch::optim::Optimizer& full,
                          const std::vector<at::Tensor>& params, const char* what) {
  std::vector<const void*> mine;
  for (const auto& group : full.param_groups()) {
    for (const auto& p : group.params()) mine.push_back(p.unsafeGetTensorImpl());
  }
  bool same = mine.size() == params.size();
  for (size_t i = 0; same && i < params.size(); ++i) {
    same = mine[i] == params[i].unsafeGetTensorImpl();
  }
  TDIST_CHECK_ARG(same, "ZeroRedundancyOptimizer::", what, ": the optimizer given holds ",
                  mine.size(), " parameters, not the ", params.size(),
                  " parameters of the ZeroRedundancyOptimizer in their order (make it over "
                  "parameters())");
}

}  // namespace

size_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  std::unordered_set<const void*> seen;
  size_t bytes = 0;
  for (const auto& [key, state] : optimizer.state()) {
    const auto* s = state.get();
    if (const auto* a = dynamic_cast<const torch::optim::AdamParamState*>(s)) {
      count_storage(a->exp_avg(), seen, bytes);
      count_storage(a->exp_avg_sq(), seen, bytes);
      count_storage(a->max_exp_avg_sq(), seen, bytes);
    } else if (const auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(s)) {
      count_storage(w->exp_avg(), seen, bytes);
      count_storage(w->exp_avg_sq(), seen, bytes);
      count_storage(w->max_exp_avg_sq(), seen, bytes);
    } else if (const auto* g = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
      count_storage(g->momentum_buffer(), seen, bytes);
    } else if (const auto* r = dynamic_cast<const torch::optim::RMSpropParamState*>(s)) {
      count_storage(r->square_avg(), seen, bytes);
      count_storage(r->momentum_buffer(), seen, bytes);
      count_storage(r->grad_avg(), seen, bytes);
    } else if (const auto* d = dynamic_cast<const torch::optim::AdagradParamState*>(s)) {
      count_storage(d->sum(), seen, bytes);
    } else {
      TDIST_THROW(InvalidArgument, "optimizer_state_bytes: the state of parameter '", key,
                  "' is of a type it does not know (known: Adam, AdamW, SGD, RMSprop, Adagrad)");
    }
  }
  return bytes;
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> params,
                                                 OptimizerFactory factory,
                                                 std::shared_ptr<comm::ProcessGroup> pg,
                                                 ZeroRedundancyOptimizerOptions opts)
    : params_(std::move(params)), pg_(std::move(pg)), opts_(opts), factory_(factory) {
  TDIST_CHECK_ARG(pg_ != nullptr, "ZeroRedundancyOptimizer: the process group is null");
  TDIST_CHECK_ARG(static_cast<bool>(factory),
                  "ZeroRedundancyOptimizer: the optimizer factory is empty");
  TDIST_CHECK_ARG(!params_.empty(), "ZeroRedundancyOptimizer: no parameters");
  std::unordered_set<const void*> seen;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    TDIST_CHECK_ARG(p.defined(), "ZeroRedundancyOptimizer: parameter ", i, " is undefined");
    TDIST_CHECK_ARG(at::isFloatingType(p.scalar_type()), "ZeroRedundancyOptimizer: parameter ", i,
                    " is ", p.scalar_type(), ", not floating point");
    TDIST_CHECK_ARG(
        p.scalar_type() == params_[0].scalar_type() && p.device() == params_[0].device(),
        "ZeroRedundancyOptimizer: parameter ", i, " is ", p.scalar_type(), " on ", p.device(),
        ", parameter 0 ", params_[0].scalar_type(), " on ", params_[0].device(),
        " (one dtype and device for all)");
    TDIST_CHECK_ARG(seen.insert(p.unsafeGetTensorImpl()).second,
                    "ZeroRedundancyOptimizer: parameter ", i, " is given twice");
  }
  const int world = pg_->size();
  const int rank = pg_->rank();

  // The ranks must agree on the shapes: their count, total elements and a position-weighted sum
  // of the numels, compared through a MIN and a MAX allreduce.
  int64_t total = 0, weighted = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    total += params_[i].numel();
    weighted += static_cast<int64_t>(i + 1) * params_[i].numel();
  }
  at::Tensor mine = at::tensor({static_cast<int64_t>(params_.size()), total, weighted}, at::kLong);
  at::Tensor lo = mine.clone(), hi = mine.clone();
  comm::AllreduceOptions ao;
  ao.timeout = opts_.timeout;
  ao.op = comm::ReduceOp::MIN;
  pg_->allreduce(lo, ao)->wait();
  ao.op = comm::ReduceOp::MAX;
  pg_->allreduce(hi, ao)->wait();
  TDIST_CHECK_ARG(lo.equal(hi),
                  "ZeroRedundancyOptimizer: the ranks passed different parameters (rank ", rank,
                  ": ", params_.size(), " parameters of ", total,
                  " elements; every rank must pass the same shapes in the same order)");

  // Note [ZeRO-1] 1: largest first, each to the least loaded rank.
  std::vector<size_t> order(params_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return params_[a].numel() > params_[b].numel(); });
  owner_.assign(params_.size(), 0);
  partition_numel_.assign(static_cast<size_t>(world), 0);
  for (size_t i : order) {
    const auto least = std::min_element(partition_numel_.begin(), partition_numel_.end());
    owner_[i] = static_cast<int>(least - partition_numel_.begin());
    *least += params_[i].numel();
  }
  owned_.assign(static_cast<size_t>(world), {});
  for (size_t i = 0; i < params_.size(); ++i) owned_[static_cast<size_t>(owner_[i])].push_back(i);

  std::vector<at::Tensor> local = local_parameters();
  if (!local.empty()) {
    local_ = factory(std::move(local));
    TDIST_CHECK_ARG(local_ != nullptr,
                    "ZeroRedundancyOptimizer: the optimizer factory returned null");
  }
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

std::vector<at::Tensor> ZeroRedundancyOptimizer::local_parameters() const {
  std::vector<at::Tensor> out;
  for (size_t i : owned_[static_cast<size_t>(pg_->rank())]) out.push_back(params_[i]);
  return out;
}

void ZeroRedundancyOptimizer::step() {
  if (local_) local_->step();
  at::NoGradGuard no_grad;
  const int world = pg_->size();
  const int rank = pg_->rank();
  std::vector<at::Tensor> flat(static_cast<size_t>(world));
  std::vector<std::shared_ptr<comm::Work>> works(static_cast<size_t>(world));
  auto issue = [&](int r) {
    const auto& mine = owned_[static_cast<size_t>(r)];
    if (mine.empty()) return;  // every rank sees the same partition: nobody broadcasts it
    at::Tensor buf;
    if (r == rank) {
      std::vector<at::Tensor> pieces;
      for (size_t i : mine) pieces.push_back(params_[i].detach().reshape({-1}));
      buf = at::cat(pieces);
    } else {
      buf = at::empty({partition_numel_[static_cast<size_t>(r)]}, params_[0].options());
    }
    comm::BroadcastOptions bo;
    bo.root = r;
    bo.timeout = opts_.timeout;
    flat[static_cast<size_t>(r)] = buf;
    works[static_cast<size_t>(r)] = pg_->broadcast(buf, bo);
  };
  // A failed broadcast leaves the next one in flight: it is waited for (its error dropped)
  // before its buffer is freed, since the group writes into it until it completes.
  auto drain = [&] {
    for (auto& w : works) {
      if (!w) continue;
      try {
        w->wait();
      } catch (...) {}
    }
  };
  try {
    issue(0);
    for (int r = 0; r < world; ++r) {
      if (r + 1 < world) issue(r + 1);  // Note [ZeRO-1] 3: one broadcast ahead
      auto& work = works[static_cast<size_t>(r)];
      if (!work) continue;
      work->wait();
      if (r != rank) {
        int64_t offset = 0;
        for (size_t i : owned_[static_cast<size_t>(r)]) {
          at::Tensor& p = params_[i];
          p.detach().copy_(flat[static_cast<size_t>(r)].narrow(0, offset, p.numel()).view_as(p));
          offset += p.numel();
        }
      }
      flat[static_cast<size_t>(r)] = at::Tensor();
      work.reset();
    }
  } catch (...) {
    drain();
    throw;
  }
}

void ZeroRedundancyOptimizer::zero_grad(bool set_to_none) {
  for (auto& p : params_) {
    if (!p.grad().defined()) continue;
    if (set_to_none) {
      p.mutable_grad() = at::Tensor();
    } else {
      p.mutable_grad().detach_();
      p.mutable_grad().zero_();
    }
  }
}

void ZeroRedundancyOptimizer::consolidate_state_dict(torch::optim::Optimizer* full, int to) {
  const int world = pg_->size();
  const int rank = pg_->rank();
  TDIST_CHECK_ARG(to >= 0 && to < world, "ZeroRedundancyOptimizer::consolidate_state_dict: rank ",
                  to, " is not in [0, ", world, ")");
  // Note [ZeRO-1] 5: libtorch's own serialization of the local optimizer, as bytes.
  std::string mine;
  if (local_) {
    std::ostringstream os;
    torch::save(*local_, os);
    mine = os.str();
  }
  at::Tensor size = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong);
  std::vector<at::Tensor> sizes;
  for (int r = 0; r < world; ++r) sizes.push_back(at::empty({1}, at::kLong));
  comm::AllgatherOptions ao;
  ao.timeout = opts_.timeout;
  pg_->allgather(sizes, size, ao)->wait();
  int64_t longest = 1;
  for (const auto& s : sizes) longest = std::max(longest, s.item<int64_t>());
  at::Tensor bytes = at::zeros({longest}, at::kByte);
  if (!mine.empty()) std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  std::vector<at::Tensor> received;
  if (rank == to) {
    for (int r = 0; r < world; ++r) received.push_back(at::empty({longest}, at::kByte));
  }
  comm::GatherOptions go;
  go.root = to;
  go.timeout = opts_.timeout;
  pg_->gather(received, bytes, go)->wait();
  if (rank != to) return;
  // Checked after the collectives, so that the other ranks are not left waiting in them.
  TDIST_CHECK_ARG(full != nullptr, "ZeroRedundancyOptimizer::consolidate_state_dict: rank ", to,
                  " receives the state and needs an optimizer over parameters() to put it in");
  check_full_optimizer(*full, params_, "consolidate_state_dict");

  for (int r = 0; r < world; ++r) {
    const auto& owned = owned_[static_cast<size_t>(r)];
    const int64_t n = sizes[static_cast<size_t>(r)].item<int64_t>();
    if (owned.empty() || n == 0) continue;
    std::vector<at::Tensor> theirs;
    for (size_t i : owned) theirs.push_back(params_[i]);
    std::unique_ptr<torch::optim::Optimizer> local = factory_(std::move(theirs));
    TDIST_CHECK_ARG(typeid(*full) == typeid(*local),
                    "ZeroRedundancyOptimizer::consolidate_state_dict: the optimizer given is a ",
                    typeid(*full).name(), ", the factory makes a ", typeid(*local).name());
    std::istringstream is(
        std::string(static_cast<const char*>(received[static_cast<size_t>(r)].data_ptr()),
                    static_cast<size_t>(n)));
    try {
      torch::load(*local, is);
    } catch (const std::exception& e) {
      TDIST_THROW(Error, "ZeroRedundancyOptimizer::consolidate_state_dict: rank ", r,
                  "'s optimizer state (", n,
                  " bytes) does not load into an optimizer the "
                  "factory makes over its ",
                  owned.size(), " parameters: ", e.what());
    }
    for (size_t i : owned) {
      void* key = params_[i].unsafeGetTensorImpl();
      auto it = local->state().find(key);
      if (it == local->state().end()) {
        full->state().erase(key);
      } else {
        full->state()[key] = std::move(it->second);
      }
    }
  }
}

void ZeroRedundancyOptimizer::load_state_dict(const torch::optim::Optimizer& full) {
  check_full_optimizer(full, params_, "load_state_dict");
  if (!local_) return;
  TDIST_CHECK_ARG(typeid(full) == typeid(*local_),
                  "ZeroRedundancyOptimizer::load_state_dict: the optimizer given is a ",
                  typeid(full).name(), ", the local optimizer a ", typeid(*local_).name(),
                  " (the factory's kind)");
  for (size_t i : owned_[static_cast<size_t>(pg_->rank())]) {
    void* key = params_[i].unsafeGetTensorImpl();
    auto it = full.state().find(key);
    if (it == full.state().end()) {
      local_->state().erase(key);
      continue;
    }
    local_->state()[key] = it->second->clone();
  }
}

size_t ZeroRedundancyOptimizer::local_state_bytes() const {
  return local_ ? optimizer_state_bytes(*local_) : 0;
}

}  // namespace tdist::fsdp
