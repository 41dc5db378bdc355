#pragma once
// Per-agent state of distributed autograd: the contexts this worker takes part in.
// Internal to tdist::autograd (tests read it to check that contexts are freed).

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tdist/autograd/context.h"
#include "tdist/autograd/detail/header.h"  // context ids: kContextRankShift, context_creator

namespace tdist::rpc {
class RpcAgent;
}

namespace tdist::autograd::detail {

struct SendRpcBackward;

// One context on one worker.
struct ContextState {
  explicit ContextState(int64_t id, int opened_by = -1) : id(id), opened_by(opened_by) {}
  const int64_t id;
  // The peer whose message made this worker join the context (-1: created here); counted
  // against that peer's Container::kMaxContextsPerPeer until the context is released.
  const int opened_by;

  std::mutex mu;
  // Send nodes recorded here, by this worker's autograd message id. Guarded by mu.
  std::unordered_map<int64_t, std::shared_ptr<SendRpcBackward>> sends;
  GradientMap grads;        // guarded by mu
  std::set<int> workers;    // ranks this worker sent to or received from; guarded by mu
  bool graph_used = false;  // creator only: a backward without retain_graph ran; guarded by mu

  std::mutex backward_mu;  // creator only: one backward of this context at a time
};

// The distributed autograd state of one RPC agent. Thread safe.
class Container {
 public:
  // Contexts a peer's messages may open here before it releases some (Note [Distributed
  // backward], "Cleanup"): beyond it a request naming a new context is refused.
  static constexpr size_t kMaxContextsPerPeer = 1024;

  explicit Container(int rank) : rank_(rank) {}
  int rank() const { return rank_; }

  std::shared_ptr<ContextState> create();
  // nullptr when this worker does not know `id` (never did, or released it).
  std::shared_ptr<ContextState> find(int64_t id);
  // The context, created on first use for a message from rank `from` (a receiver joins
  // lazily). InvalidArgument when `from` already opened kMaxContextsPerPeer contexts here.
  std::shared_ptr<ContextState> get_or_create(int64_t id, int from);
  // Forgets the context (nullptr when unknown) and what was pending for it.
  std::shared_ptr<ContextState> remove(int64_t id);
  std::vector<int64_t> context_ids();

  int64_t next_message_id() { return next_message_.fetch_add(1); }

  // Requests received in a context, until their answer is sent: (caller rank, request id).
  void add_reply(int from, uint64_t request_id, int64_t context_id);
  // The context of request (to, request_id), forgotten; -1 when it had none.
  int64_t take_reply(int to, uint64_t request_id);

 private:
  const int rank_;
  std::atomic<int64_t> next_context_{1};
  std::atomic<int64_t> next_message_{1};
  std::mutex mu_;
  std::unordered_map<int64_t, std::shared_ptr<ContextState>> contexts_;  // guarded by mu_
  std::map<std::pair<int, uint64_t>, int64_t> replies_;                  // guarded by mu_
  std::unordered_map<int, size_t> opened_;  // contexts opened by each peer; guarded by mu_
};

// The container of `agent` (created on first use; dropped when the agent is gone).
std::shared_ptr<Container> container_for(rpc::RpcAgent& agent);
// Of the calling thread's current agent (rpc/api.h).
std::shared_ptr<Container> current_container();

// The calling thread's current context id, 0 when none (ids are never 0).
int64_t thread_context();
// Sets it; returns the previous value.
int64_t set_thread_context(int64_t id);

// Sets the thread's context for a scope and restores the previous one.
class ThreadContextScope {
 public:
  explicit ThreadContextScope(int64_t id) : previous_(set_thread_context(id)) {}
  ~ThreadContextScope() { set_thread_context(previous_); }
  ThreadContextScope(const ThreadContextScope&) = delete;
  ThreadContextScope& operator=(const ThreadContextScope&) = delete;

 private:
  int64_t previous_;
};

// Number of requests answered in a context still waiting for their answer, over all agents
// (lets the response hook skip the lookup for plain RPC).
extern std::atomic<int64_t> g_pending_replies;

}  // namespace tdist::autograd::detail
