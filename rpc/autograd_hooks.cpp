#include "tdist/rpc/autograd_hooks.h"

#include <atomic>

#include "tdist/core/error.h"

namespace tdist::rpc {
namespace {
std::atomic<AutogradHooks*> g_hooks{nullptr};
}  // namespace

void set_autograd_hooks(AutogradHooks* hooks) {
  AutogradHooks* expected = nullptr;
  if (g_hooks.compare_exchange_strong(expected, hooks)) return;
  TDIST_CHECK_ARG(expected == hooks, "RPC autograd hooks are already installed");
}

AutogradHooks* autograd_hooks() { return g_hooks.load(std::memory_order_acquire); }

}  // namespace tdist::rpc
