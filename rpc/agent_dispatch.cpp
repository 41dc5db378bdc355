// RpcAgent, part 3 of 4: dispatch (agent.h has the whole contract; agent.cpp lists the parts).
// Contract of this part:
// - on_message() runs on a connection's reader thread for every complete frame and never runs
//   user code there. A RREF_FORK_REQUEST is registered right there, in order (its answer goes
//   out from the pool). Any other request counts as received and goes to the worker pool, where the
//   autograd hook (rpc/autograd_hooks.h) sees it first and request_handlers.cpp answers it. A
//   response or error completes its pending call (agent_pending.cpp): an ERROR frame becomes a
//   RemoteError naming the remote worker; a response to a call that already timed out or failed
//   is dropped, and so is one that arrives on another connection than its request left on (a
//   peer answering somebody else's call), with a log line. A completion that may send or
//   destroy RRefs (on_pool, or a response carrying RRefs) runs on the pool, the others on the
//   reader thread.
// - post_work(): work on the pool that keeps the agent busy (not idle()) until it returns; none
//   runs once the agent is stopping.
// - Every task on the pool keeps the agent alive until it ends (post_to_pool), so dropping the
//   agent's last reference inside a handler is safe.
#include "tdist/rpc/agent.h"

#include "tdist/core/logging.h"
#include "tdist/rpc/autograd_hooks.h"

namespace tdist::rpc {

using detail::Message;

namespace {
thread_local int tl_caller = -1;  // rpc/api.h current_caller()

// The caller of the request a worker thread runs, for the scope of the handler.
struct CallerScope {
  explicit CallerScope(int rank) : previous(tl_caller) { tl_caller = rank; }
  ~CallerScope() { tl_caller = previous; }
  int previous;
};
}  // namespace

int current_caller() { return tl_caller; }

void RpcAgent::post_work(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    if (stopping_) return;
    ++processing_;
  }
  auto done = [this] {
    std::lock_guard<std::mutex> lock(pending_mu_);
    if (--processing_ == 0 && pending_.empty()) idle_cv_.notify_all();
  };
  std::function<void()> task = [this, fn = std::move(fn), done] {
    try {
      fn();
    } catch (const std::exception& e) {
      TDIST_LOG_ERROR("rpc: worker '", self_.name, "': posted work threw: ", e.what());
    }
    done();
  };
  if (!post_to_pool(std::move(task))) done();
}

// Each task holds the agent until it is done with it: a handler that drops the agent's last
// other reference then destroys it when the pool releases the task (on the agent's own worker
// thread, which ThreadPool::stop allows), not while the task still uses it.
bool RpcAgent::post_to_pool(std::function<void()> task) {
  return pool_->try_post([self = weak_from_this().lock(), task = std::move(task)] { task(); });
}

void RpcAgent::on_message(const std::shared_ptr<detail::Connection>& conn, Message&& msg) {
  if (detail::is_request(msg.type)) {
    received_.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      ++processing_;
    }
    if (msg.type == detail::MessageType::kRRefForkRequest &&
        (msg.flags & detail::kFlagAutograd) == 0) {
      handle_fork_request(conn, msg);  // here, in order (Note [RRef protocol] invariant 7)
      conn->request_done();
      std::lock_guard<std::mutex> lock(pending_mu_);
      if (--processing_ == 0 && pending_.empty()) idle_cv_.notify_all();
      return;
    }
    bool posted = post_to_pool([this, conn, m = std::move(msg)]() mutable {
      CallerScope caller(m.from);
      std::shared_ptr<void> autograd_scope;  // see rpc/autograd_hooks.h
      bool ok = true;
      if (m.flags & detail::kFlagAutograd) {
        try {
          auto* hooks = autograd_hooks();
          if (!hooks) throw ProtocolError("an autograd frame reached a worker without autograd");
          autograd_scope = hooks->on_recv_request(*this, m);
        } catch (const std::exception& e) {
          ok = false;
          reply_error(conn, m.id, e.what());
        }
      }
      if (ok) handle_request(conn, m);
      autograd_scope.reset();
      conn->request_done();
      std::lock_guard<std::mutex> lock(pending_mu_);
      if (--processing_ == 0 && pending_.empty()) idle_cv_.notify_all();
    });
    if (!posted) {
      conn->request_done();
      std::lock_guard<std::mutex> lock(pending_mu_);
      --processing_;
    }
    return;
  }
  Pending p;
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    auto it = pending_.find(msg.id);
    std::string stray;
    if (it == pending_.end()) {
      if (msg.id >= next_request_id_.load() || !conn->is_outgoing()) {
        stray = "no such request was sent on that connection";
      } else {
        TDIST_LOG_DEBUG("rpc: dropping a response to request ", msg.id, " from ", conn->peer(),
                        " (timed out or already failed)");
        return;
      }
    } else if (it->second.conn.lock() != conn) {
      stray = str("that request went to ", peer_name(it->second.to));
    }
    if (!stray.empty()) {
      // Somebody answers calls it was not sent: logged once per connection.
      if (conn->first_stray_response()) {
        TDIST_LOG_WARN("rpc: worker '", self_.name, "' dropped a response to request ", msg.id,
                       " from ", conn->peer(), ": ", stray, " (further ones from it: debug)");
      } else {
        TDIST_LOG_DEBUG("rpc: dropped a response to request ", msg.id, " from ", conn->peer(), ": ",
                        stray);
      }
      return;
    }
    p = std::move(it->second);
    pending_.erase(it);
    if (p.has_deadline) deadlines_.erase({p.deadline, msg.id});
    ++processing_;
  }
  std::exception_ptr error;
  if (msg.type == detail::MessageType::kError) {
    try {
      auto body = decode<detail::ErrorBody>(msg.body);
      error = std::make_exception_ptr(
          RemoteError(str(p.what, " failed on worker '", body.worker, "': ", body.message),
                      body.worker, body.message));
    } catch (const std::exception& e) {
      error = std::make_exception_ptr(
          ProtocolError(str(p.what, " failed with an unreadable error: ", e.what())));
    }
  }
  if (!error && (msg.flags & detail::kFlagAutograd)) {  // see rpc/autograd_hooks.h
    try {
      auto* hooks = autograd_hooks();
      if (!hooks) throw ProtocolError("an autograd frame reached a worker without autograd");
      hooks->on_recv_response(*this, msg);
    } catch (const std::exception& e) {
      error = std::make_exception_ptr(
          ProtocolError(str(p.what, " failed: bad autograd response: ", e.what())));
    }
  }
  if (p.on_pool || (msg.flags & detail::kFlagHasRRefs)) {
    auto shared = std::make_shared<std::pair<Pending, Message>>(std::move(p), std::move(msg));
    bool posted =
        post_to_pool([this, shared, error] { complete(shared->first, &shared->second, error); });
    if (!posted) complete(shared->first, &shared->second, error);
    return;
  }
  complete(p, &msg, error);
}

}  // namespace tdist::rpc
