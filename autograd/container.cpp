#include "tdist/autograd/detail/container.h"

#include "tdist/autograd/detail/functions.h"
#include "tdist/core/error.h"
#include "tdist/rpc/api.h"

namespace tdist::autograd::detail {

std::atomic<int64_t> g_pending_replies{0};

namespace {

thread_local int64_t t_context = 0;

struct Entry {
  std::weak_ptr<rpc::RpcAgent> agent;
  std::shared_ptr<Container> container;
};

std::mutex g_mu;
std::unordered_map<const rpc::RpcAgent*, Entry>& containers() {
  static auto* m = new std::unordered_map<const rpc::RpcAgent*, Entry>();  // outlives agents
  return *m;
}

}  // namespace

torch::autograd::variable_list RecvRpcBackward::apply(torch::autograd::variable_list&&) {
  throw Error(str("RecvRpcBackward of distributed autograd context ", context_id,
                  " reached by a local backward; use tdist::autograd::backward(context, roots)"));
}

int64_t thread_context() { return t_context; }
int64_t set_thread_context(int64_t id) {
  int64_t prev = t_context;
  t_context = id;
  return prev;
}

std::shared_ptr<ContextState> Container::create() {
  const int64_t seq = next_context_.fetch_add(1);
  TDIST_CHECK(seq < (int64_t{1} << kContextRankShift),
              "distributed autograd context ids exhausted");
  const int64_t id = (static_cast<int64_t>(rank_) << kContextRankShift) | seq;
  auto st = std::make_shared<ContextState>(id);
  std::lock_guard<std::mutex> lock(mu_);
  contexts_.emplace(id, st);
  return st;
}

std::shared_ptr<ContextState> Container::find(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = contexts_.find(id);
  return it == contexts_.end() ? nullptr : it->second;
}

std::shared_ptr<ContextState> Container::get_or_create(int64_t id, int from) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = contexts_.find(id);
  if (it != contexts_.end()) return it->second;
  const bool counted = from != rank_;
  if (counted && opened_[from] >= kMaxContextsPerPeer) {
    throw InvalidArgument(str("worker rank ", from, " has ", kMaxContextsPerPeer,
                              " distributed autograd contexts open on worker rank ", rank_,
                              " (Container::kMaxContextsPerPeer): context ", id,
                              " refused until it releases some"));
  }
  auto st = std::make_shared<ContextState>(id, counted ? from : -1);
  contexts_.emplace(id, st);
  if (counted) ++opened_[from];
  return st;
}

std::shared_ptr<ContextState> Container::remove(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = contexts_.find(id);
  if (it == contexts_.end()) return nullptr;
  auto st = std::move(it->second);
  contexts_.erase(it);
  if (st->opened_by >= 0) {
    auto o = opened_.find(st->opened_by);
    if (o != opened_.end() && --o->second == 0) opened_.erase(o);
  }
  for (auto r = replies_.begin(); r != replies_.end();) {
    if (r->second == id) {
      r = replies_.erase(r);
      g_pending_replies.fetch_sub(1);
    } else {
      ++r;
    }
  }
  return st;
}

std::vector<int64_t> Container::context_ids() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> ids;
  for (const auto& [id, st] : contexts_) ids.push_back(id);
  return ids;
}

void Container::add_reply(int from, uint64_t request_id, int64_t context_id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (replies_.insert_or_assign({from, request_id}, context_id).second) {
    g_pending_replies.fetch_add(1);
  }
}

int64_t Container::take_reply(int to, uint64_t request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = replies_.find({to, request_id});
  if (it == replies_.end()) return -1;
  int64_t id = it->second;
  replies_.erase(it);
  g_pending_replies.fetch_sub(1);
  return id;
}

std::shared_ptr<Container> container_for(rpc::RpcAgent& agent) {
  auto weak = agent.weak_from_this();
  std::lock_guard<std::mutex> lock(g_mu);
  auto& m = containers();
  auto it = m.find(&agent);
  if (it != m.end() && (!it->second.agent.expired() || weak.expired())) {
    return it->second.container;
  }
  // A new agent (possibly at the address of a destroyed one): drop entries of dead agents.
  for (auto e = m.begin(); e != m.end();) {
    e = e->second.agent.expired() ? m.erase(e) : std::next(e);
  }
  auto c = std::make_shared<Container>(agent.rank());
  m[&agent] = Entry{weak, c};
  return c;
}

std::shared_ptr<Container> current_container() { return container_for(*rpc::current_agent()); }

}  // namespace tdist::autograd::detail
