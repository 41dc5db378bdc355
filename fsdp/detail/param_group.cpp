#include "tdist/fsdp/detail/param_group.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"

namespace tdist::fsdp::detail {
namespace {

c10::StorageImpl& storage_of(const at::Tensor& t) {
  return *t.storage().unsafeGetStorageImpl();
}

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
                       std::vector<std::string> names, std::shared_ptr<comm::ProcessGroup> pg,
                       std::chrono::milliseconds timeout, bool sync)
    : name_(std::move(name)),
      params_(std::move(params)),
      names_(std::move(names)),
      pg_(std::move(pg)),
      timeout_(timeout) {
  TDIST_CHECK_ARG(!params_.empty(), "fully_shard: unit ", name_, " has no parameters");
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
                    first.scalar_type(), " on ", first.device(),
                    "); make each kind its own unit");
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
  if (sync) {
    comm::BroadcastOptions bo;
    bo.root = 0;
    bo.timeout = timeout_;
    pg_->broadcast(flat, bo)->wait();
  }
  shard_ = flat.narrow(0, pg_->rank() * shard_numel_, shard_numel_).clone();
  shard_.set_requires_grad(true);
  full_ = at::empty({padded_numel_}, options());
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

size_t ParamGroup::unsharded_bytes() const { return storage_of(full_).nbytes(); }

bool ParamGroup::start_unshard() {
  if (unsharded_ || ag_work_) return false;
  alloc_storage(full_);
  comm::AllgatherOptions ao;
  ao.timeout = timeout_;
  ag_work_ = pg_->allgather_into_tensor(full_, shard_.detach(), ao);
  return true;
}

void ParamGroup::unshard() {
  if (unsharded_) return;
  start_unshard();
  auto work = std::move(ag_work_);
  ag_work_.reset();
  work->wait();
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
  at::Tensor flat = at::zeros({padded_numel_}, options());
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& g = params_[i].mutable_grad();
    if (!g.defined()) continue;
    flat.narrow(0, offsets_[i], numels_[i]).copy_(g.reshape({-1}));
    g = at::Tensor();
  }
  // The average as DDP computes it: each rank's share divided first, then summed, so the sum
  // never exceeds the largest gradient (Note [DDP bucketing] 6 in ddp/reducer.h).
  flat.div_(static_cast<double>(pg_->size()));
  rs_output_ = at::empty({shard_numel_}, options());
  rs_input_ = flat;
  comm::ReduceScatterOptions ro;
  ro.op = comm::ReduceOp::SUM;
  ro.timeout = timeout_;
  rs_work_ = pg_->reduce_scatter_tensor(rs_output_, rs_input_, ro);
}

void ParamGroup::finish_reduce() {
  if (!rs_work_) return;
  auto work = std::move(rs_work_);
  rs_work_.reset();
  at::Tensor out = std::move(rs_output_);
  rs_input_ = at::Tensor();
  rs_output_ = at::Tensor();
  work->wait();
  at::NoGradGuard no_grad;
  at::Tensor& g = shard_.mutable_grad();
  if (g.defined()) {
    g.add_(out);
  } else {
    g = out;
  }
}

void ParamGroup::drop_reduce() {
  rs_work_.reset();
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
