#include "tdist/fsdp/detail/param_group.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"

namespace tdist::fsdp::detail {
namespace {

c10::StorageImpl& storage_of(const at::Tensor& t) { return *t.storage().unsafeGetStorageImpl(); }

// Frees the bytes of t's storage; the storage object (and every view of it) stays.
void free_storage(const at::Tensor& t) {
  c10::StorageImpl& s = storage_of(t);
  if (s.nbytes() == 0) return;
  s.set_data_ptr_noswap(s.allocator()->allocate(0));
  s.set_nbytes(0);
}

// Gives t's (emptied) storage room for t's elements again; the values are unspecified.
void alloc_storage(const at::Tensor& t) {
  c10::StorageImpl& s = storage_of(t);
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (s.nbytes() == bytes) return;
  s.set_data_ptr_noswap(s.allocator()->allocate(bytes));
  s.set_nbytes(bytes);
}

}  // namespace

ParamGroup::ParamGroup(std::string name, std::vector<at::Tensor> params,
                       std::vector<std::string> names, const ShardingConfig& config)
    : name_(std::move(name)),
      params_(std::move(params)),
      names_(std::move(names)),
      pg_(config.shard_pg),
      replicate_pg_(config.replicate_pg && config.replicate_pg->size() > 1 ? config.replicate_pg
                                                                           : nullptr),
      timeout_(config.timeout),
      param_dtype_(config.param_dtype.value_or(params_.empty() ? at::kFloat
                                                               : params_.front().scalar_type())),
      reduce_dtype_(config.reduce_dtype.value_or(params_.empty() ? at::kFloat
                                                                 : params_.front().scalar_type())) {
  TDIST_CHECK_ARG(!params_.empty(), "fully_shard: unit ", name_, " has no parameters");
  TDIST_CHECK_ARG(pg_ != nullptr, "fully_shard: the shard group is null");
  TDIST_CHECK_ARG(at::isFloatingType(param_dtype_) && at::isFloatingType(reduce_dtype_),
                  "fully_shard: param_dtype (", param_dtype_, ") and reduce_dtype (", reduce_dtype_,
                  ") must be floating point");
  TDIST_CHECK_EQ(params_.size(), names_.size());
  const at::Tensor& first = params_.front();
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    TDIST_CHECK_ARG(p.defined() && p.is_leaf() && p.requires_grad(), "fully_shard: parameter ",
                    names_[i], " of unit ", name_,
                    " must be a leaf that requires grad (frozen parameters are not supported yet)");
    TDIST_CHECK_ARG(p.scalar_type() == first.scalar_type() && p.device() == first.device(),
                    "fully_shard: unit ", name_, " mixes dtypes or devices (", names_[i], " is ",
                    p.scalar_type(), " on ", p.device(), ", ", names_[0], " is ",
                    first.scalar_type(), " on ", first.device(), "); make each kind its own unit");
    TDIST_CHECK_ARG(at::isFloatingType(p.scalar_type()), "fully_shard: parameter ", names_[i],
                    " is not floating point (", p.scalar_type(), ")");
    shapes_.push_back(p.sizes().vec());
    offsets_.push_back(total_numel_);
    numels_.push_back(p.numel());
    total_numel_ += p.numel();
    // Created now, while p has its full shape (see accumulators()); held here because the
    // parameter holds it only weakly.
    accumulators_.push_back(torch::autograd::impl::grad_accumulator(p));
    TDIST_CHECK(accumulators_.back() != nullptr, "fully_shard: no gradient accumulator for ",
                names_[i]);
  }
  const int64_t world = pg_->size();
  padded_numel_ = (total_numel_ + world - 1) / world * world;
  shard_numel_ = padded_numel_ / world;

  at::NoGradGuard no_grad;
  at::Tensor flat = at::zeros({padded_numel_}, options());
  for (size_t i = 0; i < params_.size(); ++i) {
    flat.narrow(0, offsets_[i], numels_[i]).copy_(params_[i].detach().reshape({-1}));
  }
  if (config.sync) {
    // Global rank 0 is rank 0 of its replicate and its shard group: first every shard's rank 0
    // of the replicate groups gets its values, then each shard group gets its rank 0's.
    comm::BroadcastOptions bo;
    bo.root = 0;
    bo.timeout = timeout_;
    if (replicate_pg_) replicate_pg_->broadcast(flat, bo)->wait();
    pg_->broadcast(flat, bo)->wait();
  }
  shard_ = flat.narrow(0, pg_->rank() * shard_numel_, shard_numel_).clone();
  shard_.set_requires_grad(true);
  full_ = at::empty({padded_numel_}, compute_options());
  free_storage(full_);
  empty_ = at::empty({0}, options());
  for (const at::Tensor& p : params_) {
    p.mutable_grad() = at::Tensor();
    p.set_data(empty_);
  }
}

ParamGroup::~ParamGroup() = default;

at::TensorOptions ParamGroup::options() const {
  return at::TensorOptions().dtype(params_.front().scalar_type()).device(params_.front().device());
}

at::TensorOptions ParamGroup::compute_options() const { return options().dtype(param_dtype_); }

at::TensorOptions ParamGroup::reduce_options() const { return options().dtype(reduce_dtype_); }

size_t ParamGroup::unsharded_bytes() const { return storage_of(full_).nbytes(); }

bool ParamGroup::start_unshard() {
  if (unsharded_ || ag_work_) return false;
  alloc_storage(full_);
  comm::AllgatherOptions ao;
  ao.timeout = timeout_;
  // Mixed precision: the cast shard is what travels (half the bytes for bf16), kept alive until
  // the gather completes.
  ag_input_ = shard_.detach();
  if (param_dtype_ != shard_.scalar_type()) ag_input_ = ag_input_.to(param_dtype_);
  ag_work_ = pg_->allgather_into_tensor(full_, ag_input_, ao);
  return true;
}

void ParamGroup::unshard() {
  if (unsharded_) return;
  start_unshard();
  auto work = std::move(ag_work_);
  ag_work_.reset();
  work->wait();
  ag_input_ = at::Tensor();
  for (size_t i = 0; i < params_.size(); ++i) {
    // set_data keeps the parameter's identity (its autograd meta, accumulator and version).
    params_[i].set_data(full_.narrow(0, offsets_[i], numels_[i]).view(shapes_[i]));
  }
  unsharded_ = true;
}

void ParamGroup::reshard() {
  if (ag_work_) {
    // A prefetch nobody used: the backend writes into full_ until it completes.
    auto work = std::move(ag_work_);
    ag_work_.reset();
    work->wait();
    ag_input_ = at::Tensor();
  }
  if (!unsharded_ && storage_of(full_).nbytes() == 0) return;
  for (const at::Tensor& p : params_) p.set_data(empty_);
  free_storage(full_);
  unsharded_ = false;
}

void ParamGroup::reduce_grads() {
  TDIST_CHECK(rs_work_ == nullptr, "fsdp: unit ", name_,
              " reduced its gradients twice in one step");
  at::NoGradGuard no_grad;
  at::Tensor flat = at::zeros({padded_numel_}, reduce_options());
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& g = params_[i].mutable_grad();
    if (!g.defined()) continue;
    flat.narrow(0, offsets_[i], numels_[i]).copy_(g.reshape({-1}));
    g = at::Tensor();
  }
  // The average as DDP computes it: each rank's share divided first, then summed, so the sum
  // never exceeds the largest gradient (Note [DDP bucketing] 6 in ddp/reducer.h). With replicas
  // the sum runs over every rank: the shard group's here, the replicas' in the allreduce.
  const int64_t ranks = int64_t(pg_->size()) * (replicate_pg_ ? replicate_pg_->size() : 1);
  flat.div_(static_cast<double>(ranks));
  rs_output_ = at::empty({shard_numel_}, reduce_options());
  rs_input_ = flat;
  comm::ReduceScatterOptions ro;
  ro.op = comm::ReduceOp::SUM;
  ro.timeout = timeout_;
  rs_work_ = pg_->reduce_scatter_tensor(rs_output_, rs_input_, ro);
}

bool ParamGroup::start_replica_reduce(bool wait) {
  if (!replica_reduce_due()) return false;
  if (wait) {
    rs_work_->wait();
  } else if (!rs_work_->is_completed()) {
    return false;
  } else {
    rs_work_->wait();  // rethrows its error
  }
  rs_input_ = at::Tensor();
  comm::AllreduceOptions ao;
  ao.op = comm::ReduceOp::SUM;
  ao.timeout = timeout_;
  ar_work_ = replicate_pg_->allreduce(rs_output_, ao);
  return true;
}

void ParamGroup::release_reduce_input() {
  if (rs_work_ && rs_input_.defined() && rs_work_->is_completed()) rs_input_ = at::Tensor();
}

void ParamGroup::finish_reduce() {
  if (!rs_work_) return;
  start_replica_reduce(/*wait=*/true);
  auto work = std::move(rs_work_);
  auto replicas = std::move(ar_work_);
  rs_work_.reset();
  ar_work_.reset();
  at::Tensor out = std::move(rs_output_);
  rs_input_ = at::Tensor();
  rs_output_ = at::Tensor();
  work->wait();
  if (replicas) replicas->wait();
  at::NoGradGuard no_grad;
  if (out.scalar_type() != shard_.scalar_type()) out = out.to(shard_.scalar_type());
  at::Tensor& g = shard_.mutable_grad();
  if (g.defined()) {
    g.add_(out);
  } else {
    g = out;
  }
}

void ParamGroup::drop_reduce() {
  rs_work_.reset();
  ar_work_.reset();
  rs_input_ = at::Tensor();
  rs_output_ = at::Tensor();
}

std::vector<at::Tensor> ParamGroup::gather_full() const {
  at::NoGradGuard no_grad;
  at::Tensor flat = at::empty({padded_numel_}, options());
  comm::AllgatherOptions ao;
  ao.timeout = timeout_;
  pg_->allgather_into_tensor(flat, shard_.detach(), ao)->wait();
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    out.push_back(flat.narrow(0, offsets_[i], numels_[i]).view(shapes_[i]).clone());
  }
  return out;
}

}  // namespace tdist::fsdp::detail
