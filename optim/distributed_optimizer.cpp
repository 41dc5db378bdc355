#include "tdist/optim/distributed_optimizer.h"

#include <torch/nn/module.h>

#include "tdist/autograd/context.h"
#include "tdist/rpc/api.h"

#include <type_traits>

namespace tdist::optim {
namespace {

// Waits for every future; throws an Error naming the first owner that failed.
template <class R>
std::vector<std::conditional_t<std::is_void_v<R>, bool, R>> wait_all(
    const std::string& what, std::vector<std::pair<std::string, rpc::Future<R>>>& futures) {
  std::vector<std::conditional_t<std::is_void_v<R>, bool, R>> values;
  std::string first;
  for (auto& [owner, f] : futures) {
    try {
      if constexpr (std::is_void_v<R>) {
        f.wait();
        values.push_back(true);
      } else {
        values.push_back(f.value());
      }
    } catch (const std::exception& e) {
      if (first.empty()) first = str("owner '", owner, "': ", e.what());
      values.emplace_back();
    }
  }
  if (!first.empty()) throw Error(str("DistributedOptimizer ", what, " failed on ", first));
  return values;
}

}  // namespace

DistributedOptimizer::DistributedOptimizer(OptimizerSpec spec,
                                           std::vector<rpc::RRef<at::Tensor>> params)
    : spec_(std::move(spec)) {
  detail::register_local_optimizer();
  TDIST_CHECK_ARG(!params.empty(), "DistributedOptimizer: no parameters");
  std::vector<int> order;
  std::map<int, std::vector<rpc::RRef<at::Tensor>>> by_owner;
  for (auto& p : params) {
    TDIST_CHECK_ARG(p.valid(), "DistributedOptimizer: an empty parameter RRef");
    auto [it, inserted] = by_owner.try_emplace(p.owner());
    if (inserted) order.push_back(p.owner());
    it->second.push_back(std::move(p));
  }
  // Created outside any autograd context: the optimizer's calls are not part of a graph.
  autograd::NoContextScope none;
  std::vector<std::pair<std::string, rpc::Future<int64_t>>> created;
  for (int owner : order) {
    auto name = rpc::get_worker_info(owner).name;
    auto rref = rpc::remote<detail::LocalOptimizer>(owner, detail::kLocalOptimizerClass, spec_,
                                                    by_owner[owner]);
    created.emplace_back(name, rref.rpc_async<int64_t>("num_params"));
    remotes_.emplace_back(name, std::move(rref));
  }
  wait_all("construction", created);
}

void DistributedOptimizer::step(int64_t context_id) {
  autograd::NoContextScope none;
  std::vector<std::pair<std::string, rpc::Future<void>>> futures;
  for (auto& [owner, rref] : remotes_) {
    futures.emplace_back(owner, rref.rpc_async<void>("step", context_id));
  }
  wait_all("step of context " + std::to_string(context_id), futures);
}

std::map<std::string, std::string> DistributedOptimizer::state_dict() {
  autograd::NoContextScope none;
  std::vector<std::pair<std::string, rpc::Future<std::string>>> futures;
  for (auto& [owner, rref] : remotes_) {
    futures.emplace_back(owner, rref.rpc_async<std::string>("state"));
  }
  auto values = wait_all("state_dict", futures);
  std::map<std::string, std::string> out;
  for (size_t i = 0; i < values.size(); ++i) out[remotes_[i].first] = std::move(values[i]);
  return out;
}

void DistributedOptimizer::load_state_dict(const std::map<std::string, std::string>& state) {
  for (const auto& [owner, bytes] : state) {
    bool found = false;
    for (const auto& r : remotes_) found = found || r.first == owner;
    TDIST_CHECK_ARG(found, "load_state_dict: this DistributedOptimizer has no owner '", owner, "'");
  }
  autograd::NoContextScope none;
  std::vector<std::pair<std::string, rpc::Future<void>>> futures;
  for (auto& [owner, rref] : remotes_) {
    auto it = state.find(owner);
    if (it == state.end()) continue;
    futures.emplace_back(owner, rref.rpc_async<void>("load_state", it->second));
  }
  wait_all("load_state_dict", futures);
}

std::vector<std::string> DistributedOptimizer::owners() const {
  std::vector<std::string> names;
  for (const auto& r : remotes_) names.push_back(r.first);
  return names;
}

std::vector<rpc::RRef<at::Tensor>> parameter_rrefs(const torch::nn::Module& module) {
  std::vector<rpc::RRef<at::Tensor>> out;
  for (const auto& p : module.parameters()) out.push_back(rpc::make_rref(p));
  return out;
}

}  // namespace tdist::optim
