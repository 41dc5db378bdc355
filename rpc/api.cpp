#include "tdist/rpc/api.h"

#include <algorithm>
#include <mutex>
#include <vector>

namespace tdist::rpc {
namespace {

std::mutex g_mu;
std::shared_ptr<RpcAgent> g_agent;  // guarded by g_mu: the process's agent
thread_local std::weak_ptr<RpcAgent> tl_agent;

}  // namespace

namespace detail {
void set_thread_agent(std::weak_ptr<RpcAgent> agent) { tl_agent = std::move(agent); }
}  // namespace detail

void init_rpc(const std::string& name, int rank, int world_size, RpcOptions options) {
  auto agent = RpcAgent::start(name, rank, world_size, std::move(options));
  tl_agent = agent;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_agent || g_agent->is_shut_down()) g_agent = agent;
  // Threads other than this one reach the agent through the process slot; when another agent
  // holds it (several agents in one process), keep this one alive through a second slot.
  static std::vector<std::shared_ptr<RpcAgent>> others;
  if (g_agent != agent) {
    others.erase(std::remove_if(others.begin(), others.end(),
                                [](const auto& a) { return a->is_shut_down(); }),
                 others.end());
    others.push_back(agent);
  }
}

std::shared_ptr<RpcAgent> current_agent() {
  if (auto a = tl_agent.lock()) return a;
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_agent) return g_agent;
  throw Error("RPC is not initialized: call tdist::rpc::init_rpc() first");
}

void set_current_agent(std::shared_ptr<RpcAgent> agent) { tl_agent = agent; }

void shutdown(bool graceful) {
  auto agent = current_agent();
  std::exception_ptr error;
  try {
    agent->shutdown(graceful);
  } catch (...) {
    error = std::current_exception();
  }
  tl_agent.reset();
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_agent == agent) g_agent.reset();
  }
  if (error) std::rethrow_exception(error);
}

WorkerInfo get_worker_info() { return current_agent()->info(); }
WorkerInfo get_worker_info(const std::string& name) { return current_agent()->worker_info(name); }
WorkerInfo get_worker_info(int rank) { return current_agent()->worker_info(rank); }

}  // namespace tdist::rpc
