#include "tdist/ddp/reducer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <sstream>
#include <unordered_set>

#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"
#include "tdist/core/leaf_gradients.h"
#include "tdist/core/logging.h"

namespace tdist::ddp {
namespace {

// How long past its own timeout finalize() still waits for a bucket's collective to fail by
// itself (with the error that names the peer) before it reports the bucket as timed out.
constexpr Millis kOwnErrorGrace{2000};

}  // namespace

// Runs after the accumulator of parameter `index` wrote its gradient (Note [DDP bucketing] 2).
// Holds the Reducer by raw pointer: the Reducer removes its hooks before it is destroyed.
struct Reducer::Hook : torch::autograd::FunctionPostHook {
  Hook(Reducer* reducer, size_t index) : reducer(reducer), index(index) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    reducer->autograd_hook(index);
    return outputs;
  }
  Reducer* reducer;
  size_t index;
};

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 std::shared_ptr<comm::ProcessGroup> pg, DDPOptions opts,
                 std::shared_ptr<Trace> trace)
    : params_(std::move(params)),
      names_(std::move(names)),
      pg_(std::move(pg)),
      opts_(opts),
      trace_(std::move(trace)) {
  TDIST_CHECK_ARG(pg_ != nullptr, "DDP needs a process group");
  TDIST_CHECK_ARG(params_.size() == names_.size(), "DDP: ", params_.size(), " parameters but ",
                  names_.size(), " names");
  TDIST_CHECK_ARG(!params_.empty(), "DDP: the module has no parameters that require grad");
  TDIST_CHECK_ARG(opts_.bucket_cap_mb > 0 && opts_.first_bucket_cap_mb > 0,
                  "DDP: bucket caps must be positive (bucket_cap_mb ", opts_.bucket_cap_mb,
                  ", first_bucket_cap_mb ", opts_.first_bucket_cap_mb, ")");
  for (size_t i = 0; i < params_.size(); ++i) {
    TDIST_CHECK_ARG(params_[i].requires_grad() && params_[i].is_leaf(), "DDP: parameter ",
                    names_[i], " must be a leaf that requires grad");
  }
  for (const at::Tensor& p : params_) {
    const bool known = std::any_of(divisors_.begin(), divisors_.end(),
                                   [&](const auto& d) { return d.first == p.device(); });
    if (!known) {
      const auto options = at::TensorOptions().dtype(at::kDouble).device(p.device());
      divisors_.emplace_back(p.device(),
                             at::scalar_tensor(static_cast<double>(pg_->size()), options));
    }
  }
  std::vector<size_t> order(params_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = order.size() - 1 - i;
  build_buckets(order);
  marked_.assign(params_.size(), false);
  used_.assign(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    accumulators_.push_back(torch::autograd::impl::grad_accumulator(params_[i]));
    TDIST_CHECK(accumulators_.back() != nullptr, "DDP: no gradient accumulator for ", names_[i]);
    hook_keys_.push_back(accumulators_.back()->add_post_hook(std::make_unique<Hook>(this, i)));
  }
}

Reducer::~Reducer() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
}

void Reducer::register_comm_hook(CommHook hook) {
  TDIST_CHECK_ARG(hook != nullptr, "DDP: register_comm_hook needs a hook");
  std::lock_guard<std::mutex> lock(mu_);
  TDIST_CHECK(!reduction_started_, "DDP: register_comm_hook during an iteration");
  hook_ = std::move(hook);
  default_hook_ = false;
}

std::chrono::milliseconds Reducer::wait_timeout() const {
  return opts_.timeout.count() >= 0 ? opts_.timeout : pg_->options().timeout;
}

void Reducer::build_buckets(const std::vector<size_t>& order) {
  const size_t mib = 1024 * 1024;
  auto groups = assign_buckets(params_, order, static_cast<size_t>(opts_.first_bucket_cap_mb * mib),
                               static_cast<size_t>(opts_.bucket_cap_mb * mib));
  std::vector<Bucket> buckets(groups.size());
  locate_.assign(params_.size(), {0, 0});
  for (size_t b = 0; b < groups.size(); ++b) {
    buckets[b].params = std::move(groups[b]);
    buckets[b].allocate(params_, pg_.get());
    buckets[b].pending = buckets[b].params.size();
    for (size_t s = 0; s < buckets[b].params.size(); ++s) locate_[buckets[b].params[s]] = {b, s};
  }
  buckets_ = std::move(buckets);
}

void Reducer::reset_iteration() {
  expect_hooks_ = false;
  backward_started_ = false;
  reduction_started_ = false;
  track_used_ = false;
  std::fill(marked_.begin(), marked_.end(), false);
  std::fill(used_.begin(), used_.end(), 0);
  next_launch_ = 0;
  used_map_ = at::Tensor();
  used_future_.reset();
  leaf_grads_.reset();
  if (record_order_) ready_order_.clear();
  for (Bucket& b : buckets_) {
    b.pending = b.params.size();
    b.future.reset();
    b.work.reset();
  }
}

std::string Reducer::describe(const std::vector<size_t>& indices) const {
  std::ostringstream os;
  for (size_t k = 0; k < indices.size(); ++k) {
    if (k) os << ", ";
    os << names_[indices[k]] << " (index " << indices[k] << ")";
  }
  return os.str();
}

void Reducer::prepare_for_forward() {
  std::unique_lock<std::mutex> lock(mu_);
  if (reduction_started_) {
    std::vector<size_t> missing;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!marked_[i]) missing.push_back(i);
    }
    reset_iteration();
    TDIST_THROW(Error, "DDP on rank ", pg_->rank(),
                ": expected to have finished reduction in the prior iteration before starting a "
                "new one. The backward of the previous forward did not produce gradients for ",
                missing.empty() ? std::string("some parameters") : describe(missing),
                ". Either all outputs of forward must take part in the loss, or pass "
                "find_unused_parameters=true (or call backward after every synchronized forward).");
  }
  if (!rebuilt_ && !record_order_) rebuild_buckets();
}

void Reducer::rebuild_buckets() {
  // Note [DDP bucketing] 6: every rank takes rank 0's order.
  const int64_t n = static_cast<int64_t>(params_.size());
  at::Tensor order = at::empty({n}, at::kLong);
  auto* data = order.data_ptr<int64_t>();
  TDIST_CHECK_EQ(ready_order_.size(), params_.size(), "DDP: incomplete ready order");
  for (int64_t i = 0; i < n; ++i) data[i] = static_cast<int64_t>(ready_order_[i]);
  comm::BroadcastOptions bopts;
  bopts.root = 0;
  bopts.timeout = wait_timeout();
  pg_->broadcast(order, bopts)->wait();
  std::vector<size_t> shared(params_.size());
  std::vector<bool> seen(params_.size(), false);
  for (int64_t i = 0; i < n; ++i) {
    int64_t v = data[i];
    if (v < 0 || v >= n || seen[v]) {
      TDIST_THROW(ProtocolError, "DDP on rank ", pg_->rank(),
                  ": rank 0's gradient order is not a permutation of the parameters (entry ", i,
                  " is ", v, ")");
    }
    seen[v] = true;
    shared[i] = static_cast<size_t>(v);
  }
  build_buckets(shared);
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& grad = params_[i].mutable_grad();
    auto [b, s] = locate_[i];
    if (!grad.defined() || !as_views(buckets_[b])) continue;
    buckets_[b].views[s].copy_(grad);
    grad = buckets_[b].views[s];
  }
  rebuilt_ = true;
  TDIST_LOG_DEBUG("DDP: rebuilt ", buckets_.size(), " buckets in the order gradients became ready");
}

void Reducer::prepare_for_backward(const std::vector<at::Tensor>& outputs, bool outputs_known) {
  std::unique_lock<std::mutex> lock(mu_);
  reset_iteration();
  const bool search = opts_.find_unused_parameters || (opts_.static_graph && !static_known_);
  TDIST_CHECK(!search || outputs_known,
              "DDP: find_unused_parameters (and static_graph) walk the autograd graph from "
              "forward's outputs, but forward returned a type whose tensors DDP cannot see; "
              "return tensors, vectors, tuples, pairs or maps of them");
  expect_hooks_ = true;
  track_used_ = search;
  std::vector<size_t> unused;
  if (search) {
    unused = find_unreached(outputs);
    if (opts_.static_graph) static_unused_ = unused;
  } else if (opts_.static_graph) {
    unused = static_unused_;
  }
  for (size_t i : unused) mark_ready(i, /*used=*/false);
  launch_ready(lock);
}

std::vector<size_t> Reducer::find_unreached(const std::vector<at::Tensor>& outputs) const {
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  auto visit = [&](torch::autograd::Node* node) {
    if (node && seen.insert(node).second) stack.push_back(node);
  };
  for (const at::Tensor& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    if (out.grad_fn()) {
      visit(out.grad_fn().get());
    } else {
      visit(torch::autograd::impl::try_get_grad_accumulator(out).get());
    }
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) visit(edge.function.get());
  }
  std::vector<size_t> unreached;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!seen.count(accumulators_[i].get())) unreached.push_back(i);
  }
  return unreached;
}

void Reducer::autograd_hook(size_t index) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!expect_hooks_) return;  // Note [DDP bucketing] 7
  if (!backward_started_) {
    backward_started_ = true;
    backward_begin_us_ = Trace::now_us();
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize(); });
    // Note [DDP bucketing] 9: where this backward keeps the gradients.
    leaf_grads_ = tdist::current_leaf_gradients();
  }
  mark_ready(index, /*used=*/true);
  launch_ready(lock);
}

void Reducer::mark_ready(size_t index, bool used) {
  TDIST_CHECK(!marked_[index], "DDP on rank ", pg_->rank(), ": parameter ", names_[index],
              " was marked ready twice in one iteration (a second backward through the same "
              "forward, or a parameter that find_unused_parameters thought unused got a "
              "gradient); DDP reduces each parameter once per forward");
  marked_[index] = true;
  used_[index] = used ? 1 : 0;
  reduction_started_ = true;
  if (record_order_) ready_order_.push_back(index);
  auto [b, s] = locate_[index];
  Bucket& bucket = buckets_[b];
  at::Tensor& view = bucket.views[s];
  // The built-in hook averages as sum of quotients (Note [DDP bucketing] 6): divide while
  // copying. div rather than PyTorch's multiplication by 1/world: one correctly rounded
  // operation, the same result for worlds that are powers of two.
  // Note [DDP bucketing] 11: float and double gradients reduced where they lie are averaged by
  // the collective instead.
  const bool divide = default_hook_ && !averaged_by_collective(bucket);
  if (!passthrough()) {  // world size 1, built-in hook: the gradient already is the average
    at::Tensor& target = bucket.targets[s];
    target = view;
    tdist::with_leaf_gradient(leaf_grads_, params_[index], [&](at::Tensor& grad) {
      if (!grad.defined()) {
        view.zero_();
      } else if (as_views(bucket) && grad.data_ptr() == view.data_ptr()) {
        if (divide) view.div_(world_divisor(view.device()));
      } else if (used && reduce_in_place(bucket) && reducible_in_place(grad, view)) {
        if (divide) grad.div_(world_divisor(view.device()));  // Note [DDP bucketing] 11
        target = grad;
      } else {
        // Without bucket views, or a new gradient (first backward, zero_grad(set_to_none)) that
        // moves into the bucket.
        if (divide) {
          at::div_out(view, grad, world_divisor(view.device()));
        } else {
          view.copy_(grad);
        }
        if (as_views(bucket)) grad = view;
      }
    });
  }
  TDIST_CHECK_GT(bucket.pending, 0u, "DDP: bucket ", b, " over-counted");
  --bucket.pending;
}

void Reducer::launch_ready(std::unique_lock<std::mutex>& lock) {
  // Note [DDP bucketing] 3: one launcher at a time, strictly in index order, hooks without mu_.
  if (launching_) return;  // the launcher takes what became ready
  launching_ = true;
  struct EndLaunching {
    Reducer* r;
    std::unique_lock<std::mutex>& lock;
    ~EndLaunching() {
      if (!lock.owns_lock()) lock.lock();
      r->launching_ = false;
      r->launch_cv_.notify_all();
    }
  } end_launching{this, lock};
  for (;;) {
    if (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
      const size_t b = next_launch_++;
      Bucket& bucket = buckets_[b];
      std::vector<at::Tensor> params;
      params.reserve(bucket.params.size());
      for (size_t i : bucket.params) params.push_back(params_[i]);
      GradBucket view(b, buckets_.size(), bucket.buffer, bucket.views, std::move(params),
                      bucket.offsets, pg_);
      bucket.launch_us = Trace::now_us();
      if (passthrough()) {
        bucket.future = comm::Future::completed({bucket.buffer});
        continue;
      }
      const bool builtin = default_hook_;
      const bool average = averaged_by_collective(bucket);
      std::vector<at::Tensor> targets;
      if (reduce_in_place(bucket)) targets = bucket.targets;
      lock.unlock();
      std::shared_ptr<comm::Work> work;
      auto future = launch_bucket(b, view, builtin, std::move(targets), average, &work);
      lock.lock();
      buckets_[b].future = std::move(future);
      buckets_[b].work = std::move(work);
      add_trace(b);
    } else if (track_used_ && next_launch_ == buckets_.size() && !used_map_.defined()) {
      // Note [DDP bucketing] 5: every parameter was marked, so the map is complete.
      used_map_ = at::empty({static_cast<int64_t>(params_.size())}, at::kInt);
      std::copy(used_.begin(), used_.end(), used_map_.data_ptr<int32_t>());
      at::Tensor used = used_map_;
      lock.unlock();
      auto future = launch_used_map(used);
      lock.lock();
      used_future_ = std::move(future);
    } else {
      return;
    }
  }
}

// Called without mu_. The hook's or the collective's error becomes the bucket's failed future,
// reported (with the bucket) at the end of backward.
std::shared_ptr<comm::Future> Reducer::launch_bucket(size_t b, GradBucket& view, bool builtin,
                                                     std::vector<at::Tensor> targets, bool average,
                                                     std::shared_ptr<comm::Work>* work) {
  try {
    std::shared_ptr<comm::Future> future;
    if (!targets.empty()) {  // Note [DDP bucketing] 11
      comm::AllreduceCoalescedOptions aopts;
      if (average) aopts.op = comm::ReduceOp::AVG;
      future = pg_->allreduce_coalesced(std::move(targets), aopts)->future();
    } else if (builtin) {
      comm::AllreduceOptions aopts;  // SUM of quotients (Note [DDP bucketing] 6), or AVG (12)
      if (average) aopts.op = comm::ReduceOp::AVG;
      auto w = pg_->allreduce(view.buffer(), aopts);
      future = w->future();
      if (!view.buffer().is_cpu()) *work = std::move(w);  // Note [DDP bucketing] 10
    } else {
      future = hook_(view);  // hook_ does not change during an iteration
    }
    TDIST_CHECK(future != nullptr, "DDP: the comm hook returned no future for bucket ", b);
    return future;
  } catch (...) {
    return comm::Future::failed(std::current_exception());
  }
}

std::shared_ptr<comm::Future> Reducer::launch_used_map(const at::Tensor& used) {
  try {
    comm::AllreduceOptions aopts;
    aopts.timeout = wait_timeout();
    return pg_->allreduce(used, aopts)->future();
  } catch (...) {
    return comm::Future::failed(std::current_exception());
  }
}

void Reducer::add_trace(size_t b) {
  if (!trace_) return;
  const Bucket& bucket = buckets_[b];
  auto trace = trace_;
  int64_t begin = bucket.launch_us;
  std::string args = tdist::str("\"bucket\": ", b, ", \"params\": ", bucket.params.size(),
                                ", \"bytes\": ", bucket.bytes());
  bucket.future->add_callback([trace, b, begin, args](comm::Future&) {
    trace->add(tdist::str("comm bucket ", b), Trace::Track::kComm, begin, Trace::now_us(), args);
  });
}

void Reducer::finalize() {
  std::unique_lock<std::mutex> lock(mu_);
  if (!expect_hooks_) return;
  // The engine runs this after every hook returned, so nobody launches now; wait all the same.
  launch_cv_.wait(lock, [&] { return !launching_; });
  const int64_t wait_begin = Trace::now_us();
  struct ResetOnExit {
    Reducer* r;
    std::unique_lock<std::mutex>& lock;
    ~ResetOnExit() {
      if (!lock.owns_lock()) lock.lock();
      r->reset_iteration();
    }
  } reset_on_exit{this, lock};

  if (next_launch_ < buckets_.size()) {
    std::vector<size_t> missing;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!marked_[i]) missing.push_back(i);
    }
    TDIST_THROW(Error, "DDP on rank ", pg_->rank(), ": backward finished without gradients for ",
                describe(missing),
                ". These parameters were not used to compute the loss. Pass "
                "find_unused_parameters=true if that is expected, or make every output of forward "
                "take part in the loss.");
  }
  TDIST_CHECK(!track_used_ || used_future_ != nullptr, "DDP: the used map was not launched");
  // Wait without mu_ (a hook's continuation may query the Reducer).
  std::vector<std::shared_ptr<comm::Future>> futures;
  std::vector<std::shared_ptr<comm::Work>> device_works;  // Note [DDP bucketing] 10
  std::vector<size_t> sizes;
  for (const Bucket& bucket : buckets_) {
    futures.push_back(bucket.future);
    if (bucket.work) device_works.push_back(bucket.work);
    sizes.push_back(bucket.params.size());
  }
  const auto used_future = used_future_;
  const size_t num_buckets = buckets_.size();
  const int rank = pg_->rank();
  const auto timeout = wait_timeout();
  lock.unlock();
  for (size_t b = 0; b < num_buckets; ++b) {
    const auto& f = futures[b];
    try {
      f->wait(timeout);
    } catch (const std::exception& e) {
      if (!f->completed()) {
        // The collective has a deadline of its own, which started with it (before this wait
        // did), and its error names the peer it waited for: give it a moment to fail by itself.
        try {
          f->wait(std::min(timeout, kOwnErrorGrace));
        } catch (const std::exception&) {}
      }
      if (!f->completed()) {
        TDIST_THROW(TimeoutError, "DDP on rank ", rank, ": waited ", timeout.count(),
                    " ms at the end of backward for the communication of bucket ", b, " of ",
                    num_buckets, " (", sizes[b], " parameters): ", e.what());
      }
      if (!f->has_error()) continue;  // it completed during the grace
      try {
        std::rethrow_exception(f->error());
      } catch (const std::exception& own) {
        TDIST_THROW(Error, "DDP on rank ", rank, ": the communication of bucket ", b,
                    " failed: ", own.what());
      }
    }
  }
  if (used_future) {
    try {
      used_future->wait(timeout);
    } catch (const std::exception& e) {
      TDIST_THROW(Error, "DDP on rank ", rank,
                  ": the allreduce of the map of used parameters (find_unused_parameters) "
                  "failed: ",
                  e.what());
    }
  }
  // Note [DDP bucketing] 10: the current streams wait for the collectives (their futures
  // completed, so this does not block the host).
  for (const auto& work : device_works) work->wait();
  lock.lock();
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    if (reduce_in_place(bucket)) continue;  // reduced where its targets lie (Note 11)
    const auto& value = bucket.future->value();
    TDIST_CHECK(!value.empty() && value[0].defined() && value[0].numel() == bucket.buffer.numel(),
                "DDP: the comm hook's result for bucket ", b, " must be one tensor of ",
                bucket.buffer.numel(), " elements");
    if (value[0].data_ptr() != bucket.buffer.data_ptr()) {
      bucket.buffer.copy_(value[0].reshape({-1}));
    }
  }
  const int64_t reduced_us = Trace::now_us();

  // Note [DDP bucketing] 5: which parameters did any rank use?
  std::vector<bool> global_unused(params_.size(), false);
  if (track_used_) {
    const int32_t* u = used_map_.data_ptr<int32_t>();
    for (size_t i = 0; i < params_.size(); ++i) global_unused[i] = u[i] == 0;
    if (opts_.static_graph && !static_known_) {
      static_global_unused_ = global_unused;
      static_known_ = true;
    }
  } else if (opts_.static_graph && static_known_) {
    global_unused = static_global_unused_;
  }
  if (!passthrough()) write_back(global_unused);
  if (record_order_) {
    record_order_ = false;  // Note [DDP bucketing] 6: rebuild at the next forward
    if (ready_order_.size() != params_.size()) rebuilt_ = true;  // nothing usable to rebuild by
  }
  if (trace_) {
    trace_->add("backward", Trace::Track::kCompute, backward_begin_us_, wait_begin,
                tdist::str("\"buckets\": ", buckets_.size()));
    trace_->add("final wait", Trace::Track::kCompute, wait_begin, reduced_us);
  }
}

bool Reducer::passthrough() const { return default_hook_ && pg_->size() == 1; }

bool Reducer::as_views(const Bucket& bucket) const {
  return opts_.gradient_as_bucket_view || (default_hook_ && bucket.symmetric);
}

bool Reducer::reduce_in_place(const Bucket& bucket) const {
  return default_hook_ && !as_views(bucket) && bucket.buffer.is_cpu();
}

bool Reducer::averaged_by_collective(const Bucket& bucket) const {
  const auto t = bucket.buffer.scalar_type();
  return (reduce_in_place(bucket) || (default_hook_ && bucket.symmetric)) &&
         (t == at::kFloat || t == at::kDouble);
}

bool Reducer::reducible_in_place(const at::Tensor& grad, const at::Tensor& view) {
  return grad.layout() == at::kStrided && grad.is_cpu() && grad.is_contiguous() &&
         grad.scalar_type() == view.scalar_type() && grad.sizes() == view.sizes() &&
         !grad.requires_grad() && !grad.is_conj() && !grad.is_neg();
}

const at::Tensor& Reducer::world_divisor(const at::Device& device) const {
  for (const auto& [d, divisor] : divisors_) {
    if (d == device) return divisor;
  }
  TDIST_THROW(Error, "DDP: no world-size divisor for device ", device.str(),
              " (a parameter moved to another device after DDP was built?)");
}

void Reducer::write_back(const std::vector<bool>& global_unused) {
  // The buckets hold the averages (the built-in hook divided before its allreduce, or the
  // collective averaged).
  for (size_t i = 0; i < params_.size(); ++i) {
    if (global_unused[i]) continue;
    auto [b, s] = locate_[i];
    const at::Tensor& view = buckets_[b].views[s];
    if (!buckets_[b].targets[s].is_same(view)) continue;  // reduced in place (Note 11)
    tdist::with_leaf_gradient(leaf_grads_, params_[i], [&](at::Tensor& grad) {
      if (as_views(buckets_[b])) {
        if (!grad.defined() || grad.data_ptr() != view.data_ptr()) grad = view;
      } else if (!grad.defined()) {
        grad = view.clone();
      } else {
        grad.copy_(view);
      }
    });
  }
}

std::vector<std::vector<size_t>> Reducer::bucket_indices() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::vector<size_t>> out;
  for (const Bucket& b : buckets_) out.push_back(b.params);
  return out;
}

size_t Reducer::num_buckets() const {
  std::lock_guard<std::mutex> lock(mu_);
  return buckets_.size();
}

bool Reducer::buckets_rebuilt() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rebuilt_;
}

}  // namespace tdist::ddp
