// Context lifetime and cleanup (Note [Distributed backward], "Cleanup", in engine.cpp).
#include "tdist/autograd/context.h"

#include <mutex>

#include "tdist/autograd/detail/container.h"
#include "tdist/autograd/detail/engine.h"
#include "tdist/core/logging.h"
#include "tdist/rpc/api.h"

namespace tdist::autograd {
namespace detail {
namespace {

// Removes the context here and sends RELEASE to the workers it knew, except `except`; waits.
void release(rpc::RpcAgent& agent, int64_t context_id, int except) {
  auto st = container_for(agent)->remove(context_id);
  if (!st) return;
  std::set<int> workers;
  {
    std::lock_guard<std::mutex> lock(st->mu);
    workers = st->workers;
  }
  ThreadContextScope none(0);
  std::vector<std::pair<int, rpc::Future<void>>> futures;
  for (int w : workers) {
    if (w == agent.rank() || w == except) continue;
    try {
      futures.emplace_back(
          w, agent.rpc_async<void>(w, kReleaseFn, context_id, static_cast<int32_t>(agent.rank())));
    } catch (const std::exception& e) {
      TDIST_LOG_WARN("autograd: cannot release context ", context_id, " on worker rank ", w, ": ",
                     e.what());
    }
  }
  for (auto& [w, f] : futures) {
    try {
      f.wait();
    } catch (const std::exception& e) {
      TDIST_LOG_WARN("autograd: releasing context ", context_id, " on worker rank ", w,
                     " failed: ", e.what());
    }
  }
}

}  // namespace

// Only a worker that took part in the context (its creator, or one this worker exchanged a
// message of the context with) may release it here; the rank it names must be its own.
void handle_release(int64_t context_id, int32_t from) {
  auto agent = rpc::current_agent();
  const int caller = rpc::current_caller();
  auto st = container_for(*agent)->find(context_id);
  if (!st) return;  // released already (idempotent)
  bool took_part =
      caller == from && (caller == context_creator(context_id) || caller == agent->rank());
  if (!took_part && caller == from) {
    std::lock_guard<std::mutex> lock(st->mu);
    took_part = st->workers.count(caller) > 0;
  }
  TDIST_CHECK_ARG(took_part, "worker rank ", caller,
                  " did not take part in distributed autograd "
                  "context ",
                  context_id, " on worker '", agent->info().name, "'",
                  caller == from ? std::string() : str(" (it named rank ", from, ")"),
                  ": release refused");
  release(*agent, context_id, from);
}

}  // namespace detail

Context::Context() {
  init();
  agent_ = rpc::current_agent();
  TDIST_CHECK_ARG(detail::thread_context() == 0, "a distributed autograd context (",
                  detail::thread_context(), ") is already current on this thread");
  id_ = detail::container_for(*agent_)->create()->id;
  detail::set_thread_context(id_);
}

Context::~Context() {
  if (detail::thread_context() == id_) detail::set_thread_context(0);
  try {
    detail::release(*agent_, id_, -1);
  } catch (const std::exception& e) {
    TDIST_LOG_WARN("autograd: releasing context ", id_, " failed: ", e.what());
  }
}

std::optional<int64_t> current_context() {
  const int64_t id = detail::thread_context();
  if (id == 0) return std::nullopt;
  return id;
}

NoContextScope::NoContextScope() : previous_(detail::set_thread_context(0)) {}
NoContextScope::~NoContextScope() { detail::set_thread_context(previous_); }

GradientMap get_gradients(int64_t context_id) {
  auto agent = rpc::current_agent();
  auto st = detail::container_for(*agent)->find(context_id);
  TDIST_CHECK_ARG(st != nullptr, "get_gradients: distributed autograd context ", context_id,
                  " is not known on worker '", agent->info().name, "' (never created or released)");
  std::lock_guard<std::mutex> lock(st->mu);
  return st->grads;
}

void init() {
  static std::once_flag once;
  std::call_once(once, [] {
    rpc::register_function(detail::kBackwardFn, &detail::handle_backward);
    rpc::register_function(detail::kReleaseFn, &detail::handle_release);
    detail::install_hooks();
  });
}

namespace {
// Installs distributed autograd when the library loads (see init()).
[[maybe_unused]] const bool g_installed = (init(), true);
}  // namespace

}  // namespace tdist::autograd
