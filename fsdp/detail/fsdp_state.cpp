#include "tdist/fsdp/detail/fsdp_state.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "tdist/comm/device_mesh.h"
#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"
#include "tdist/fsdp/detail/boundary.h"
#include "tdist/fsdp/detail/param_group.h"

namespace tdist::fsdp::detail {
namespace {

using torch::nn::Module;

struct Registry {
  std::mutex mu;
  // guarded by mu: unit module -> (its state, its group or -1 when it has no parameters)
  std::unordered_map<const Module*, std::pair<std::weak_ptr<FSDPState>, int>> units;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: states may outlive static teardown
  return *r;
}

}  // namespace

// Runs after the accumulator of parameter `index` of group `group` wrote its gradient.
struct FSDPState::GradHook : torch::autograd::FunctionPostHook {
  GradHook(std::weak_ptr<FSDPState> state, int group) : state(std::move(state)), group(group) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto st = state.lock()) st->on_grad_ready(group);
    return outputs;
  }
  std::weak_ptr<FSDPState> state;
  int group;
};

std::pair<std::shared_ptr<FSDPState>, int> find_unit(const Module* module) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.units.find(module);
  if (it == r.units.end()) return {nullptr, -1};
  auto st = it->second.first.lock();
  if (!st) return {nullptr, -1};
  return {std::move(st), it->second.second};
}

FSDPState::FSDPState(std::shared_ptr<Module> root, std::shared_ptr<comm::ProcessGroup> pg,
                     std::shared_ptr<comm::ProcessGroup> replicate_pg, FSDPOptions opts)
    : root_(std::move(root)),
      pg_(std::move(pg)),
      replicate_pg_(replicate_pg && replicate_pg->size() > 1 ? std::move(replicate_pg) : nullptr),
      opts_(opts) {}

std::shared_ptr<FSDPState> FSDPState::create(std::shared_ptr<Module> root,
                                             std::vector<std::shared_ptr<Module>> units,
                                             std::shared_ptr<comm::ProcessGroup> pg,
                                             FSDPOptions opts) {
  TDIST_CHECK_ARG(root != nullptr, "fully_shard: the root module is null");
  TDIST_CHECK_ARG(pg != nullptr, "fully_shard: the process group is null");
  const int n = pg->size();
  const int shard = opts.shard_size;
  TDIST_CHECK_ARG(shard >= 0, "fully_shard: shard_size is ", shard,
                  "; it must be positive (or 0: the whole group)");
  if (shard == 0 || shard == n) return create_sharded(root, units, std::move(pg), nullptr, opts);
  TDIST_CHECK_ARG(n % shard == 0, "fully_shard: shard_size ", shard,
                  " does not divide the process group's size ", n,
                  " (HSDP needs replicas of equal shard groups)");
  // Note [Device mesh layout] in comm/device_mesh.h: shard groups of consecutive ranks.
  comm::DeviceMesh mesh(pg, {{"replicate", n / shard}, {"shard", shard}});
  return create_sharded(root, units, mesh.group("shard"), mesh.group("replicate"), opts);
}

std::shared_ptr<FSDPState> FSDPState::create(std::shared_ptr<Module> root,
                                             std::vector<std::shared_ptr<Module>> units,
                                             const comm::DeviceMesh& mesh, FSDPOptions opts) {
  TDIST_CHECK_ARG(root != nullptr, "fully_shard: the root module is null");
  TDIST_CHECK_ARG(mesh.has_dim("shard"),
                  "fully_shard: the mesh has no \"shard\" dimension to "
                  "shard across (and optionally a \"replicate\" one to replicate across)");
  const int shard = mesh.size("shard");
  TDIST_CHECK_ARG(opts.shard_size == 0 || opts.shard_size == shard, "fully_shard: shard_size ",
                  opts.shard_size, " contradicts the mesh's \"shard\" dimension of ", shard,
                  "; leave shard_size 0 with a mesh");
  opts.shard_size = shard;
  return create_sharded(std::move(root), units, mesh.group("shard"),
                        mesh.has_dim("replicate") ? mesh.group("replicate") : nullptr, opts);
}

std::shared_ptr<FSDPState> FSDPState::create_sharded(
    std::shared_ptr<Module> root, const std::vector<std::shared_ptr<Module>>& units,
    std::shared_ptr<comm::ProcessGroup> pg, std::shared_ptr<comm::ProcessGroup> replicate_pg,
    FSDPOptions opts) {
  if (opts.param_dtype) {
    TDIST_CHECK_ARG(at::isFloatingType(*opts.param_dtype), "fully_shard: param_dtype ",
                    *opts.param_dtype, " is not floating point");
  }
  if (opts.reduce_dtype) {
    TDIST_CHECK_ARG(at::isFloatingType(*opts.reduce_dtype), "fully_shard: reduce_dtype ",
                    *opts.reduce_dtype, " is not floating point");
  }
  std::shared_ptr<FSDPState> st(
      new FSDPState(std::move(root), std::move(pg), std::move(replicate_pg), opts));
  st->build(units);
  for (size_t g = 0; g < st->groups_.size(); ++g) {
    const auto& accumulators = st->groups_[g]->accumulators();
    for (size_t i = 0; i < accumulators.size(); ++i) {
      uintptr_t key =
          accumulators[i]->add_post_hook(std::make_unique<GradHook>(st, static_cast<int>(g)));
      st->hook_keys_.push_back({g, i, key});
    }
  }
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const auto& [m, g] : st->registered_) r.units[m] = {st, g};
  return st;
}

std::chrono::milliseconds FSDPState::timeout() const {
  return opts_.timeout.count() >= 0 ? opts_.timeout : pg_->options().timeout;
}

void FSDPState::build(const std::vector<std::shared_ptr<Module>>& units) {
  std::unordered_map<const Module*, std::string> path;
  for (const auto& item : root_->named_modules("", /*include_self=*/false)) {
    path[item.value().get()] = item.key();
  }
  std::unordered_set<const Module*> seen;
  for (size_t i = 0; i < units.size(); ++i) {
    const Module* u = units[i].get();
    TDIST_CHECK_ARG(u != nullptr, "fully_shard: unit ", i, " is null");
    TDIST_CHECK_ARG(u != root_.get(), "fully_shard: unit ", i,
                    " is the root module itself; list only its submodules (the root's own "
                    "parameters form a group of their own)");
    auto it = path.find(u);
    TDIST_CHECK_ARG(it != path.end(), "fully_shard: unit ", i, " (", u->name(),
                    ") is not a submodule of the root module (", root_->name(), ")");
    TDIST_CHECK_ARG(seen.insert(u).second, "fully_shard: unit ", it->second, " is listed twice");
    TDIST_CHECK_ARG(find_unit(u).first == nullptr, "fully_shard: unit ", it->second,
                    " is already sharded by another FullyShardedModule");
  }

  // Inner units claim their parameters first (FSDP2: fully_shard applies bottom-up); a unit
  // has strictly fewer descendants than any unit that contains it.
  std::vector<size_t> order(units.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::vector<size_t> sizes;
  for (const auto& u : units) sizes.push_back(u->modules(false).size());
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return sizes[a] < sizes[b]; });

  std::unordered_map<const c10::TensorImpl*, const Module*> owner;
  struct Claim {
    std::string name;
    const Module* module;
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
  };
  std::unordered_set<const Module*> unit_set;
  for (const auto& u : units) unit_set.insert(u.get());
  // The parameters of m's own modules: m and its submodules but for the units inside it (and
  // theirs), which claimed their parameters before m. One already claimed by another unit is
  // shared by two units (a tied weight): each would free it while the other may be using it.
  auto claim = [&](const Module& m, const std::string& name, const std::string& prefix) {
    Claim c{name, &m, {}, {}};
    std::function<void(const Module&, const std::string&)> visit = [&](const Module& mod,
                                                                       const std::string& at) {
      for (const auto& item : mod.named_parameters(/*recurse=*/false)) {
        const c10::TensorImpl* impl = item.value().unsafeGetTensorImpl();
        auto it = owner.find(impl);
        if (it != owner.end()) {
          if (it->second == &m) continue;  // tied inside this unit: one parameter of its group
          TDIST_THROW(InvalidArgument, "fully_shard: parameter ", prefix, at, item.key(),
                      " is shared by units ", path[it->second], " and ", name,
                      "; a parameter shared by two units (tied weights) is not supported: make "
                      "one unit that contains every module using it (e.g. keep a tied embedding "
                      "and output layer both in the root, outside the units)");
        }
        owner[impl] = &m;
        c.params.push_back(item.value());
        c.names.push_back(prefix + at + item.key());
      }
      for (const auto& child : mod.named_children()) {
        if (unit_set.count(child.value().get()) != 0) continue;  // an inner unit: claimed
        visit(*child.value(), at + child.key() + ".");
      }
    };
    visit(m, "");
    return c;
  };
  std::vector<Claim> claims;
  for (size_t i : order) {
    const std::string& name = path[units[i].get()];
    claims.push_back(claim(*units[i], name, name + "."));
  }
  claims.push_back(claim(*root_, "(root)", ""));

  const bool sync = opts_.sync_module_states;
  ShardingConfig config;
  config.shard_pg = pg_;
  config.replicate_pg = replicate_pg_;
  config.timeout = timeout();
  config.sync = sync;
  config.param_dtype = opts_.param_dtype;
  config.reduce_dtype = opts_.reduce_dtype;
  for (size_t k = 0; k < claims.size(); ++k) {
    Claim& c = claims[k];
    const bool is_root = k + 1 == claims.size();
    int g = -1;
    if (!c.params.empty()) {
      g = static_cast<int>(groups_.size());
      groups_.push_back(
          std::make_unique<ParamGroup>(c.name, std::move(c.params), std::move(c.names), config));
    }
    if (is_root) {
      root_group_ = g;
    } else {
      registered_.emplace_back(c.module, g);
    }
  }
  if (sync) {
    at::NoGradGuard no_grad;
    comm::BroadcastOptions bo;
    bo.timeout = timeout();
    for (const at::Tensor& b : root_->buffers(/*recurse=*/true)) {
      if (!b.defined()) continue;
      if (replicate_pg_) replicate_pg_->broadcast(b, bo)->wait();  // as ParamGroup's values
      pg_->broadcast(b, bo)->wait();
    }
  }
  steps_.assign(groups_.size(), Step{});
}

FSDPState::~FSDPState() {
  for (const HookKey& k : hook_keys_) {
    groups_[k.group]->accumulators()[k.index]->del_post_hook(k.key);
  }
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const auto& reg : registered_) {
    auto it = r.units.find(reg.first);
    if (it != r.units.end() && it->second.first.expired()) r.units.erase(it);
  }
}

void FSDPState::begin_iteration() {
  // A forward after a backward that failed midway, or after a forward whose result got no
  // backward: start over (what is still gathered is reused).
  for (auto& g : groups_) g->drop_reduce();
  replicating_.clear();
  steps_.assign(groups_.size(), Step{});
  forward_order_.clear();
  callback_queued_ = false;
}

void FSDPState::end_iteration() {
  last_order_ = forward_order_;
  last_position_.assign(groups_.size(), -1);
  for (size_t i = 0; i < last_order_.size(); ++i) last_position_[last_order_[i]] = int(i);
  steps_.assign(groups_.size(), Step{});
  forward_order_.clear();
  callback_queued_ = false;
}

void FSDPState::unshard(int g) {
  ParamGroup& group = *groups_[g];
  if (group.unsharded()) return;
  if (!group.unshard_pending()) ++counters_.allgathers;
  group.unshard();
}

void FSDPState::prefetch(int g, int direction) {
  if (opts_.prefetch <= 0 || last_order_.empty()) return;
  // g < 0: before the first group (the root's forward when the root has no group of its own).
  int at = g < 0 ? -1 : last_position_[g];
  if (g >= 0 && at < 0) return;
  // The root's group begins backward before every unit (its forward ran around theirs): the
  // units backward meets first are the last of the forward order, gathered while the root's
  // own backward (a model's head) computes.
  if (g == root_group_ && direction < 0) at = static_cast<int>(last_order_.size());
  for (int k = 1; k <= opts_.prefetch; ++k) {
    const int i = at + k * direction;
    if (i < 0 || i >= static_cast<int>(last_order_.size())) break;
    const int h = last_order_[i];
    if (h == root_group_) continue;
    if (groups_[h]->start_unshard()) {
      ++counters_.allgathers;
      ++counters_.prefetched;
    }
  }
}

void FSDPState::cast_inputs(std::vector<at::Tensor>& inputs) const {
  if (!opts_.param_dtype || !opts_.cast_forward_inputs) return;
  for (at::Tensor& t : inputs) {
    if (t.defined() && at::isFloatingType(t.scalar_type()) &&
        t.scalar_type() != *opts_.param_dtype) {
      t = t.to(*opts_.param_dtype);  // differentiable: the input's gradient keeps its dtype
    }
  }
}

void FSDPState::pre_forward(int g, std::vector<at::Tensor>& inputs) {
  cast_inputs(inputs);
  if (g == kRoot) {
    begin_iteration();
    g = root_group_;
    if (g < 0) {
      if (at::GradMode::is_enabled()) prefetch(-1, +1);
      return;
    }
  }
  ParamGroup& group = *groups_.at(g);
  Step& step = steps_[g];
  const bool grad = at::GradMode::is_enabled();
  TDIST_CHECK(!(grad && step.forwarded), "fsdp: unit ", group.name(),
              " ran forward twice in one iteration; each unit runs once between a forward of "
              "the root and its backward");
  unshard(g);
  if (!grad) return;
  step.forwarded = true;
  forward_order_.push_back(g);
  prefetch(g, +1);
  std::weak_ptr<FSDPState> weak = weak_from_this();
  insert_backward_hook(
      inputs,
      [weak, g] {
        if (auto st = weak.lock()) st->post_backward(g);
      },
      "tdist::fsdp::PostBackward(" + group.name() + ")");
}

void FSDPState::post_forward(int g, std::vector<at::Tensor>& outputs, bool outputs_known) {
  if (g == kRoot) {
    g = root_group_;
    if (g < 0) return;
  }
  ParamGroup& group = *groups_.at(g);
  if (!at::GradMode::is_enabled() || !steps_[g].forwarded) {
    group.reshard();  // no backward will need them
    return;
  }
  std::weak_ptr<FSDPState> weak = weak_from_this();
  insert_backward_hook(
      outputs,
      [weak, g] {
        if (auto st = weak.lock()) st->pre_backward(g);
      },
      "tdist::fsdp::PreBackward(" + group.name() + ")");
  // The root's backward starts as soon as forward ends: keep its parameters (FSDP2 does too).
  // Outputs we cannot see may lead a backward into the unit without the pre-backward node.
  if (opts_.reshard_after_forward && g != root_group_ && outputs_known) group.reshard();
}

void FSDPState::ensure_final_callback() {
  if (callback_queued_) return;
  callback_queued_ = true;
  std::weak_ptr<FSDPState> weak = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto st = weak.lock()) st->finish_backward();
  });
}

void FSDPState::check_forwarded(int g) const {
  TDIST_CHECK(steps_.at(g).forwarded, "fsdp: backward reached unit ", groups_[g]->name(),
              " whose forward is not part of this step (a second backward through one forward, "
              "or another forward of the root before this backward); run one backward per "
              "forward of the root");
}

void FSDPState::pre_backward(int g) {
  check_forwarded(g);
  ensure_final_callback();
  Step& step = steps_.at(g);
  if (step.pre_backward) return;
  step.pre_backward = true;
  for (auto& group : groups_) group->release_reduce_input();
  unshard(g);
  prefetch(g, -1);
}

void FSDPState::on_grad_ready(int g) {
  check_forwarded(g);
  ensure_final_callback();
  Step& step = steps_.at(g);
  if (++step.grads_ready == groups_[g]->params().size()) post_backward(g);
}

void FSDPState::post_backward(int g) {
  Step& step = steps_.at(g);
  if (!step.forwarded || step.post_backward) return;
  ensure_final_callback();
  step.post_backward = true;
  // The gathered parameters go before the flat gradient is allocated (the gradients are tensors
  // of their own): the two never take memory at once.
  groups_[g]->reshard();
  // Earlier groups' flat gradients whose reduce-scatter has completed are not kept to the end
  // of backward (at most one in flight on a quick network, as with FSDP2).
  for (auto& group : groups_) group->release_reduce_input();
  if (require_sync_) {
    groups_[g]->reduce_grads();
    ++counters_.reduce_scatters;
    if (replicate_pg_) {
      replicating_.push_back(g);
      start_replica_reduces(/*wait=*/false);
    }
  }
}

void FSDPState::start_replica_reduces(bool wait) {
  // In the reduce-scatters' order, which every rank shares; a later group waits for an earlier
  // one (its reduce-scatter completes later on the same shard group anyway).
  while (!replicating_.empty()) {
    ParamGroup& group = *groups_[replicating_.front()];
    if (group.replica_reduce_due()) {
      if (!group.start_replica_reduce(wait)) return;
      ++counters_.replica_allreduces;
    }
    replicating_.pop_front();
  }
}

void FSDPState::finish_backward() {
  try {
    // Units whose post-backward step has not run (a parameter got no gradient and no input
    // needed one; the root): in reverse forward order, the same order on every rank.
    for (auto it = forward_order_.rbegin(); it != forward_order_.rend(); ++it) post_backward(*it);
    start_replica_reduces(/*wait=*/true);
    for (auto& g : groups_) g->finish_reduce();
  } catch (...) {
    begin_iteration();
    throw;
  }
  for (auto& g : groups_) g->reshard();
  end_iteration();
}

double FSDPState::clip_grad_norm(double max_norm, double norm_type) {
  const bool inf = std::isinf(norm_type);
  TDIST_CHECK_ARG(inf || norm_type > 0, "clip_grad_norm: norm_type must be positive or inf, not ",
                  norm_type);
  at::NoGradGuard no_grad;
  // Each rank's part (its shards; the padding's gradient is zero), in double on the host,
  // summed over the shard group only: HSDP's replicas hold the same gradients.
  double local = 0;
  for (const auto& g : groups_) {
    const at::Tensor& grad = g->sharded_param().grad();
    if (!grad.defined() || grad.numel() == 0) continue;
    if (inf) {
      local = std::max(local, grad.abs().max().item<double>());
    } else {
      local += grad.to(at::kDouble).abs().pow(norm_type).sum().item<double>();
    }
  }
  at::Tensor total = at::full({1}, local, at::kDouble);
  comm::AllreduceOptions ao;
  ao.op = inf ? comm::ReduceOp::MAX : comm::ReduceOp::SUM;
  ao.timeout = timeout();
  pg_->allreduce(total, ao)->wait();
  const double norm = inf ? total.item<double>() : std::pow(total.item<double>(), 1.0 / norm_type);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1) {
    for (const auto& g : groups_) {
      const at::Tensor& grad = g->sharded_param().grad();
      if (grad.defined()) grad.mul_(coef);
    }
  }
  return norm;
}

std::vector<at::Tensor> FSDPState::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& g : groups_) out.push_back(g->sharded_param());
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FSDPState::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& g : groups_) out.emplace_back(g->name(), g->sharded_param());
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FSDPState::full_parameters() const {
  std::unordered_map<const c10::TensorImpl*, at::Tensor> full;
  for (const auto& g : groups_) {
    auto values = g->gather_full();
    for (size_t i = 0; i < values.size(); ++i) {
      full[g->params()[i].unsafeGetTensorImpl()] = values[i];
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : root_->named_parameters(/*recurse=*/true)) {
    auto it = full.find(item.value().unsafeGetTensorImpl());
    if (it != full.end()) out.emplace_back(item.key(), it->second);
  }
  return out;
}

size_t FSDPState::unsharded_bytes() const {
  size_t n = 0;
  for (const auto& g : groups_) n += g->unsharded_bytes();
  return n;
}

}  // namespace tdist::fsdp::detail
