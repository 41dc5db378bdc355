#include "tests/autograd/autograd_test_util.h"

#include <mutex>

namespace tdist::autograd::test {
namespace {

std::mutex g_mu;
std::map<std::string, at::Tensor>& params() {
  static std::map<std::string, at::Tensor> m;
  return m;
}

std::string me() { return rpc::current_agent()->info().name; }

void register_once() {
  // stage(x, this worker's parameter `key`)
  rpc::register_function("ag.stage",
                         [](std::string key, at::Tensor x) { return stage(x, param(me(), key)); });
  rpc::register_function("ag.mul", [](at::Tensor a, at::Tensor b) { return a * b; });
  rpc::register_function("ag.add_scaled", [](at::Tensor a, at::Tensor b) { return a + 2 * b; });
  // remote result used on a third worker: fetches it, then runs its own stage.
  rpc::register_function("ag.stage_of_rref", [](std::string key, rpc::RRef<at::Tensor> r) {
    return stage(r.to_here(), param(me(), key));
  });
  // Nested: stage here, then call `next` with the rest of the chain: [(worker, key), ...].
  rpc::register_function("ag.chain",
                         [](std::vector<std::pair<std::string, std::string>> rest, std::string key,
                            at::Tensor x) -> at::Tensor {
                           at::Tensor h = stage(x, param(me(), key));
                           if (rest.empty()) return h;
                           auto [next, next_key] = rest.front();
                           rest.erase(rest.begin());
                           return rpc::rpc_sync<at::Tensor>(next, "ag.chain", rest, next_key, h);
                         });
  rpc::register_function("ag.fail", [](at::Tensor x) -> at::Tensor {
    throw std::runtime_error("forward failed on purpose (" + std::to_string(x.numel()) + ")");
  });
  rpc::register_function("ag.context_here", []() -> int64_t {
    auto c = current_context();
    return c ? *c : 0;
  });
}

}  // namespace

at::Tensor& param(const std::string& worker, const std::string& key) {
  std::lock_guard<std::mutex> lock(g_mu);
  return params()[worker + "/" + key];
}

void clear_params() {
  std::lock_guard<std::mutex> lock(g_mu);
  params().clear();
}

Agents start(int n, rpc::RpcOptions options) {
  static std::once_flag once;
  std::call_once(once, register_once);
  init();
  return rpc::test::start_agents(n, options);
}

GradientMap gradients_on(const std::shared_ptr<rpc::RpcAgent>& agent, int64_t id) {
  return as_worker(agent, [&] { return get_gradients(id); });
}

std::vector<int64_t> contexts_on(const std::shared_ptr<rpc::RpcAgent>& agent) {
  return detail::container_for(*agent)->context_ids();
}

bool all_released(Agents& a) {
  return rpc::test::eventually([&] {
    for (auto& agent : a.agents) {
      if (!contexts_on(agent).empty()) return false;
    }
    return true;
  });
}

}  // namespace tdist::autograd::test
