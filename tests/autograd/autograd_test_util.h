#pragma once
// Helpers of the distributed autograd tests: agents as threads of this process (tests/rpc's
// start_agents), per-worker parameters, and the functions the tests call remotely.

#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tdist/autograd/context.h"
#include "tdist/autograd/detail/container.h"
#include "tests/rpc/rpc_test_util.h"

namespace tdist::autograd::test {

using rpc::test::Agents;

// A random float64 tensor that requires grad.
inline at::Tensor leaf(std::vector<int64_t> shape) {
  return torch::randn(shape, torch::kFloat64).requires_grad_(true);
}

// Parameters of the workers of this process, by "<worker>/<key>" (a test puts them here before
// its forward pass and compares their gradients afterwards).
at::Tensor& param(const std::string& worker, const std::string& key);
void clear_params();

// Registers the test functions (once per process) and starts n agents w0..w{n-1}.
Agents start(int n, rpc::RpcOptions options = {});

// Runs fn with `agent` as the calling thread's current agent, then restores the previous one.
template <class Fn>
auto as_worker(const std::shared_ptr<rpc::RpcAgent>& agent, Fn fn) {
  struct Restore {
    std::shared_ptr<rpc::RpcAgent> previous;
    ~Restore() { rpc::set_current_agent(previous); }
  } restore;
  try {
    restore.previous = rpc::current_agent();
  } catch (const std::exception&) {}
  rpc::set_current_agent(agent);
  return fn();
}

// The gradients worker `agent` holds in context `id`.
GradientMap gradients_on(const std::shared_ptr<rpc::RpcAgent>& agent, int64_t id);
// Context ids the worker still holds.
std::vector<int64_t> contexts_on(const std::shared_ptr<rpc::RpcAgent>& agent);
// True once no worker of `a` holds a context (bounded wait).
bool all_released(Agents& a);

// The stage every test model uses: tanh(x @ w).
inline at::Tensor stage(const at::Tensor& x, const at::Tensor& w) {
  return torch::tanh(x.matmul(w));
}

}  // namespace tdist::autograd::test
