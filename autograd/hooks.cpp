// Distributed autograd's side of rpc/autograd_hooks.h: what a message sent or received inside a
// context records (Note [Distributed backward] in engine.cpp), and the header that carries it
// (Note [Autograd frame header] in detail/header.h).
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

#include "tdist/autograd/detail/container.h"
#include "tdist/autograd/detail/functions.h"
#include "tdist/autograd/detail/header.h"
#include "tdist/core/error.h"
#include "tdist/rpc/agent.h"
#include "tdist/rpc/autograd_hooks.h"

namespace tdist::autograd::detail {
namespace {

using rpc::Message;
using rpc::MessageType;
using rpc::OutMessage;

bool carries_context(MessageType t) {
  switch (t) {
    case MessageType::kCall:
    case MessageType::kRemoteCall:
    case MessageType::kRRefFetch:
    case MessageType::kRRefMethodCall:
    case MessageType::kRRefMethodRemote:
      return true;
    default:
      return false;
  }
}

// Records a SendRpcBackward for the tensors of `m` that require grad; fills h.
void record_send(Container& c, ContextState& st, OutMessage& m, Header& h) {
  std::vector<uint32_t> indices;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    if (m.tensors[i].defined() && m.tensors[i].requires_grad()) {
      indices.push_back(static_cast<uint32_t>(i));
    }
  }
  if (indices.empty()) return;
  auto send = std::make_shared<SendRpcBackward>();
  torch::autograd::edge_list edges;
  for (uint32_t i : indices) {
    send->add_input_metadata(m.tensors[i]);
    edges.push_back(torch::autograd::impl::gradient_edge(m.tensors[i]));
  }
  send->set_next_edges(std::move(edges));
  h.message_id = c.next_message_id();
  h.indices = std::move(indices);
  std::lock_guard<std::mutex> lock(st.mu);
  st.sends.emplace(h.message_id, std::move(send));
}

// Gives the tensors named by h a RecvRpcBackward of (context, sender, message).
void record_recv(ContextState& st, Message& m, const Header& h) {
  {
    std::lock_guard<std::mutex> lock(st.mu);
    st.workers.insert(m.from);
  }
  if (h.indices.empty()) return;
  auto recv = std::make_shared<RecvRpcBackward>(h.context_id, m.from, h.message_id);
  for (uint32_t i : h.indices) {
    at::Tensor& t = m.tensors[i];
    if (!torch::autograd::isDifferentiableType(t.scalar_type())) {
      throw ProtocolError(tdist::str("autograd header marks a tensor of type ",
                                     c10::toString(t.scalar_type()), " as requiring grad"));
    }
    t = t.detach();  // a fresh autograd identity (the received tensor may view a frame buffer)
    torch::autograd::set_history(t, recv);
  }
}

class Hooks final : public rpc::AutogradHooks {
 public:
  void on_send_request(rpc::RpcAgent& agent, int to, OutMessage& m) override {
    const int64_t ctx = thread_context();
    if (ctx == 0 || !carries_context(m.type)) return;
    auto c = container_for(agent);
    auto st = c->find(ctx);
    TDIST_CHECK_ARG(st != nullptr, "distributed autograd context ", ctx,
                    " is not known on worker '", agent.info().name, "' (released?)");
    {
      std::lock_guard<std::mutex> lock(st->mu);
      st->workers.insert(to);
    }
    Header h;
    h.context_id = ctx;
    record_send(*c, *st, m, h);
    prepend_header(m, h);
  }

  void on_send_response(rpc::RpcAgent& agent, int to, OutMessage& m) override {
    if (g_pending_replies.load(std::memory_order_relaxed) == 0) return;
    auto c = container_for(agent);
    const int64_t ctx = c->take_reply(to, m.id);
    if (ctx < 0 || m.type != MessageType::kResponse) return;
    auto st = c->find(ctx);
    if (!st) return;  // released while the call ran: nothing to record
    Header h;
    h.context_id = ctx;
    record_send(*c, *st, m, h);
    if (!h.indices.empty()) prepend_header(m, h);
  }

  std::shared_ptr<void> on_recv_request(rpc::RpcAgent& agent, Message& m) override {
    Header h = take_header(m, agent.world_size());
    auto c = container_for(agent);
    auto st = c->get_or_create(h.context_id, m.from);  // bounded per peer
    record_recv(*st, m, h);
    c->add_reply(m.from, m.id, h.context_id);
    return std::make_shared<ThreadContextScope>(h.context_id);
  }

  void on_recv_response(rpc::RpcAgent& agent, Message& m) override {
    Header h = take_header(m, agent.world_size());
    auto st = container_for(agent)->get_or_create(h.context_id, m.from);
    record_recv(*st, m, h);
  }
};

}  // namespace

void install_hooks() {
  static Hooks hooks;
  rpc::set_autograd_hooks(&hooks);
}

}  // namespace tdist::autograd::detail
