#include "tdist/rpc/detail/dispatcher.h"

#include "tdist/core/logging.h"
#include "tdist/rpc/agent.h"
#include "tdist/rpc/autograd_hooks.h"

namespace tdist::rpc {

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

namespace detail {

Dispatcher::Dispatcher(RpcAgent& agent, RequestHandler& handler, PendingCalls& pending,
                       std::unique_ptr<ThreadPool> pool)
    : agent_(agent), handler_(handler), pending_(pending), pool_(std::move(pool)) {}

// Each task holds the agent until it is done with it: a handler that drops the agent's last
// other reference then destroys it when the pool releases the task (on the agent's own worker
// thread, which ThreadPool::stop allows), not while the task still uses it.
bool Dispatcher::post(std::function<void()> task) {
  return pool_->try_post(
      [self = agent_.weak_from_this().lock(), task = std::move(task)] { task(); });
}

void Dispatcher::on_message(const std::shared_ptr<Connection>& conn, Message&& msg) {
  if (!is_request(msg.type)) {
    on_response(conn, std::move(msg));
    return;
  }
  received_.fetch_add(1);
  pending_.enter();
  if (msg.type == MessageType::kRRefForkRequest && (msg.flags & kFlagAutograd) == 0) {
    handler_.handle_fork_request(conn, msg);  // here, in order (Note [RRef protocol] invariant 7)
    conn->request_done();
    pending_.leave();
    return;
  }
  bool posted = post([this, conn, m = std::move(msg)]() mutable {
    CallerScope caller(m.from);
    std::shared_ptr<void> autograd_scope;  // see rpc/autograd_hooks.h
    bool ok = true;
    if (m.flags & kFlagAutograd) {
      try {
        auto* hooks = autograd_hooks();
        if (!hooks) throw ProtocolError("an autograd frame reached a worker without autograd");
        autograd_scope = hooks->on_recv_request(agent_, m);
      } catch (const std::exception& e) {
        ok = false;
        handler_.reply_error(conn, m.id, e.what());
      }
    }
    if (ok) handler_.handle_request(conn, m);
    autograd_scope.reset();
    conn->request_done();
    pending_.leave();
  });
  if (!posted) {
    conn->request_done();
    pending_.leave();
  }
}

void Dispatcher::on_response(const std::shared_ptr<Connection>& conn, Message&& msg) {
  auto taken = pending_.take_response(msg.id, *conn);
  if (!taken.call) {
    if (taken.stray.empty()) {
      TDIST_LOG_DEBUG("rpc: dropping a response to request ", msg.id, " from ", conn->peer(),
                      " (timed out or already failed)");
    } else if (conn->first_stray_response()) {
      // Somebody answers calls it was not sent: logged once per connection.
      TDIST_LOG_WARN("rpc: worker '", agent_.info().name, "' dropped a response to request ",
                     msg.id, " from ", conn->peer(), ": ", taken.stray,
                     " (further ones from it: debug)");
    } else {
      TDIST_LOG_DEBUG("rpc: dropped a response to request ", msg.id, " from ", conn->peer(), ": ",
                      taken.stray);
    }
    return;
  }
  PendingCalls::Call p = std::move(*taken.call);
  std::exception_ptr error;
  if (msg.type == MessageType::kError) {
    try {
      auto body = decode<ErrorBody>(msg.body);
      error = std::make_exception_ptr(
          RemoteError(str(p.what, " failed on worker '", body.worker, "': ", body.message),
                      body.worker, body.message));
    } catch (const std::exception& e) {
      error = std::make_exception_ptr(
          ProtocolError(str(p.what, " failed with an unreadable error: ", e.what())));
    }
  }
  if (!error && (msg.flags & kFlagAutograd)) {  // see rpc/autograd_hooks.h
    try {
      auto* hooks = autograd_hooks();
      if (!hooks) throw ProtocolError("an autograd frame reached a worker without autograd");
      hooks->on_recv_response(agent_, msg);
    } catch (const std::exception& e) {
      error = std::make_exception_ptr(
          ProtocolError(str(p.what, " failed: bad autograd response: ", e.what())));
    }
  }
  if (p.on_pool || (msg.flags & kFlagHasRRefs)) {
    auto shared =
        std::make_shared<std::pair<PendingCalls::Call, Message>>(std::move(p), std::move(msg));
    bool posted =
        post([this, shared, error] { pending_.complete(shared->first, &shared->second, error); });
    if (!posted) pending_.complete(shared->first, &shared->second, error);
    return;
  }
  pending_.complete(p, &msg, error);
}

}  // namespace detail
}  // namespace tdist::rpc
