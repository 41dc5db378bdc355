// RpcAgent: its parts wired together and its life (agent.h has the whole contract). start()
// checks the options, makes the parts (rpc/detail/: Membership, ConnectionTable, PendingCalls,
// RequestHandler, Dispatcher), listens and joins the group; send_request() registers a call with
// PendingCalls and sends it on the ConnectionTable's connection to the peer; the connections'
// events go to the Dispatcher (frames, whose requests the RequestHandler answers) and the
// ConnectionTable (closes, which fail the calls pending on a lost connection); shutdown() runs
// Membership's rounds (Note [RPC graceful shutdown]) and stop_everything() stops the parts in
// order.
#include "tdist/rpc/agent.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include "tdist/core/net/handshake.h"
#include "tdist/core/logging.h"
#include "tdist/core/rendezvous.h"
#include "tdist/core/token.h"
#include "tdist/rpc/api.h"
#include "tdist/rpc/autograd_hooks.h"
#include "tdist/rpc/detail/connection_table.h"
#include "tdist/rpc/detail/dispatcher.h"
#include "tdist/rpc/detail/membership.h"
#include "tdist/rpc/detail/options.h"
#include "tdist/rpc/detail/pending_calls.h"
#include "tdist/rpc/detail/request_handler.h"
#include "tdist/rpc/detail/thread_pool.h"

namespace tdist::rpc {

namespace {

// Note [RPC waits spin first]
// A small call's round trip crosses two sockets and two thread hand-offs: the server's reader
// thread to a worker of the pool, and the client's reader thread to the caller waiting on the
// future. Waking a sleeping thread through a condition variable costs several microseconds of
// system call and scheduling, more on a virtual machine whose idle core must be woken too, so
// each waiting side first keeps looking for a while, yielding the core between looks (on a
// host with fewer cores than busy threads, the thread it waits for needs that core):
// Future::wait for up to 50 us (rpc/future.h); one idle worker of the pool for up to spin_us
// (default 50 us, rpc/detail/thread_pool.h); and each connection's reader, between frames, reads
// without blocking for up to spin_us before it sleeps in recv, or, once frames come through a
// shared-memory ring, looks at the ring before it sleeps on its futex (rpc/detail/connection.cpp,
// Note [RPC shared-memory frame streams]). A busy caller
// keeps them looking between calls; an idle agent looks once per message and then sleeps, so it
// burns no core. spin_us = 0 (TDIST_RPC_SPIN_US=0) restores the plain hand-offs (the future's
// spin stays). Measured with tdist-bench rpc (docs/perf-history.md, "RPC waits spin first").

}  // namespace

namespace {

// The options every connection of the agent shares.
detail::ConnectionOptions connection_options(const RpcOptions& o, int rank, int world_size) {
  detail::ConnectionOptions c;
  c.max_frame_bytes = o.max_frame_bytes;
  c.max_requests_in_flight = o.max_requests_in_flight;
  c.send_timeout = o.rpc_timeout;
  c.frame_timeout = o.rpc_timeout;
  c.handshake.token = *o.token;
  c.handshake.my_rank = rank;
  c.handshake.world_size = world_size;
  c.handshake.issued = std::make_shared<net::IssuedChallenges>();
  c.handshake.fast_path = o.same_host_fast_path;
  c.handshake.timeout = o.handshake_timeout;
  c.socket_buffer_bytes = o.socket_buffer_bytes;
  c.spin = std::chrono::microseconds(o.spin_us);
  c.shm_bytes = static_cast<uint64_t>(o.shm_bytes);
  c.stream_bytes = static_cast<uint64_t>(o.stream_bytes);
  return c;
}

Millis join_timeout(const RpcOptions& o) {
  return o.rpc_timeout.count() > 0 ? o.rpc_timeout : Store::kDefaultTimeout;
}

}  // namespace

RpcAgent::RpcAgent(const std::string& name, int rank, int world_size, RpcOptions options)
    : options_(std::move(options)) {
  TDIST_CHECK_ARG(world_size > 0, "world_size must be positive, got ", world_size);
  TDIST_CHECK_ARG(rank >= 0 && rank < world_size, "rank ", rank, " is not in [0, ", world_size,
                  ")");
  TDIST_CHECK_ARG(!name.empty(), "a worker needs a name");
  self_.name = name;
  self_.rank = rank;
  options_ = detail::resolve_options(std::move(options_));
  Token token = resolve_token(options_.token, "RpcOptions::token");
  options_.token = token.value;
  token_source_ = token.source;
}

std::shared_ptr<RpcAgent> RpcAgent::start(const std::string& name, int rank, int world_size,
                                          RpcOptions options) {
  std::shared_ptr<RpcAgent> a(new RpcAgent(name, rank, world_size, std::move(options)));
  std::weak_ptr<RpcAgent> weak = a;
  RpcAgent* raw = a.get();
  const RpcOptions& o = a->options_;
  a->rrefs_ = std::make_shared<detail::RRefContext>(weak, rank);
  auto pool = std::make_unique<detail::ThreadPool>(
      o.num_worker_threads, [weak] { detail::set_thread_agent(weak); },
      std::chrono::microseconds(o.spin_us));
  // What PendingCalls and the RequestHandler ask of the agent.
  auto peer_name = [raw](int r) { return raw->peer_name(r); };
  auto post = [raw](std::function<void()> task) { return raw->post_to_pool(std::move(task)); };
  a->pending_ = std::make_unique<detail::PendingCalls>(name, peer_name, post);
  a->handler_ =
      std::make_unique<detail::RequestHandler>(*raw, a->self_, a->rrefs_, post, peer_name);
  a->dispatcher_ =
      std::make_unique<detail::Dispatcher>(*raw, *a->handler_, *a->pending_, std::move(pool));
  a->members_ = std::make_unique<detail::Membership>(a->self_, o, world_size);
  detail::ConnectionLimits limits;
  limits.max_pending_handshakes = o.max_pending_handshakes;
  limits.max_connections = o.max_connections;
  limits.max_connections_per_peer = o.max_connections_per_peer;
  a->connections_ = std::make_unique<detail::ConnectionTable>(
      world_size, *a->members_, connection_options(o, rank, world_size), limits,
      static_cast<detail::ConnectionHandler*>(raw), &a->dispatcher_->pool());
  // The store's host decides the address this worker listens on.
  a->host_ = o.listen_host.empty() ? net::local_address(a->members_->store().server_host())
                                   : o.listen_host;
  // Note [Secure by default] (core/token.h): decided from the address this worker binds.
  require_token_beyond_loopback(str("the RPC agent of worker '", name, "'"), !o.token->empty(),
                                a->host_, "RpcOptions::token");
  a->connections_->listen(a->host_, o.listen_port);
  a->connections_->start_accepting();
  a->pending_->start();
  try {
    a->members_->join(world_size, a->host_, a->port(), join_timeout(o));
  } catch (...) {
    a->stop_everything("start failed");
    throw;
  }
  TDIST_LOG_INFO("rpc: worker '", name, "' (rank ", rank, " of ", world_size, ") listening on ",
                 a->host_, ":", a->port(),
                 o.token->empty() ? "" : " (token from " + a->token_source_ + ")");
  if (o.token->empty()) {
    TDIST_LOG_WARN("rpc: worker '", name, "': the RPC port ", a->host_, ":", a->port(),
                   " is unauthenticated: anyone who can reach it can call every "
                   "registered function (set TDIST_TOKEN or TDIST_TOKEN_FILE on every worker)");
  }
  return a;
}

RpcAgent::~RpcAgent() { stop_everything("agent destroyed"); }

int RpcAgent::world_size() const { return members_->world_size(); }
const std::vector<WorkerInfo>& RpcAgent::workers() const { return members_->workers(); }
const WorkerInfo& RpcAgent::worker_info(const To& to) const { return members_->worker_info(to); }
std::string RpcAgent::peer_name(int rank) const { return members_->peer_name(rank); }
uint16_t RpcAgent::port() const { return connections_->port(); }
detail::Executor* RpcAgent::executor() { return &dispatcher_->pool(); }
int64_t RpcAgent::requests_sent() const { return pending_->sent(); }
int64_t RpcAgent::requests_received() const { return dispatcher_->received(); }
size_t RpcAgent::num_pending() const { return pending_->size(); }
bool RpcAgent::idle() const { return pending_->idle(); }
void RpcAgent::post_work(std::function<void()> fn) { pending_->post_work(std::move(fn)); }
void RpcAgent::schedule(Clock::time_point when, std::function<void()> fn) {
  pending_->schedule(when, std::move(fn));
}
bool RpcAgent::post_to_pool(std::function<void()> task) {
  return dispatcher_->post(std::move(task));
}

void RpcAgent::send_request(int to, detail::OutMessage&& m, Millis timeout,
                            detail::ResponseFn on_done, std::string what, bool on_pool) {
  const uint64_t id = pending_->add(to, timeout, std::move(on_done), std::move(what), on_pool);
  if (id == 0) return;  // stopping: failed already
  m.id = id;
  try {
    if (auto* hooks = autograd_hooks()) hooks->on_send_request(*this, to, m);
    // A call without a timeout still gives up connecting after one handshake timeout.
    const Millis connect_for =
        timeout.count() > 0 ? timeout : connections_->options().handshake.timeout;
    auto conn = connections_->connection_to(to, Clock::now() + connect_for);
    pending_->set_connection(id, conn);
    conn->send(std::move(m));
  } catch (const std::exception& e) {
    pending_->fail_send(id, e, std::current_exception());
  }
}

void RpcAgent::on_message(const std::shared_ptr<detail::Connection>& conn, detail::Message&& msg) {
  dispatcher_->on_message(conn, std::move(msg));
}

std::string RpcAgent::on_authenticated(const std::shared_ptr<detail::Connection>& conn) {
  return connections_->check_authenticated(conn);
}

void RpcAgent::on_closed(const std::shared_ptr<detail::Connection>& conn,
                         const std::string& reason) {
  if (connections_->on_closed(conn, reason)) pending_->fail_lost(conn->peer_rank(), reason);
}

void RpcAgent::shutdown(bool graceful) {
  TDIST_CHECK_ARG(!(graceful && dispatcher_ && dispatcher_->pool().in_pool_thread()),
                  "shutdown() of worker '", self_.name,
                  "' called on one of its own worker "
                  "threads (from a function called over RPC): it would wait for that very call; "
                  "shut down from the program's own thread");
  std::lock_guard<std::mutex> guard(shutdown_mu_);
  if (stopped_.load()) return;
  std::exception_ptr error;
  if (graceful) {
    const Millis limit =
        options_.shutdown_timeout.count() > 0 ? options_.shutdown_timeout : Millis(1LL << 40);
    detail::ShutdownHooks hooks;
    hooks.begin_round = [this](int round) {
      if (round > 0) rrefs_->delete_all_users();
    };
    hooks.wait_idle = [this](Clock::time_point deadline) { return pending_->wait_idle(deadline); };
    hooks.describe_busy = [this] { return pending_->describe_busy(); };
    hooks.counts = [this] { return std::make_pair(pending_->sent(), dispatcher_->received()); };
    hooks.lost_peers = [this] { return connections_->lost_peers(); };
    try {
      members_->shutdown_rounds(limit, hooks);
    } catch (...) {
      error = std::current_exception();
    }
  }
  auto leaks = rrefs_->registered();
  if (!leaks.empty()) {
    TDIST_LOG_WARN("rpc: worker '", self_.name, "' shuts down with ", leaks.size(),
                   " RRefs still referenced (leaked):");
    for (const auto& l : leaks) TDIST_LOG_WARN("rpc:   ", l);
  }
  {
    std::lock_guard<std::mutex> lock(leaks_mu_);
    leaked_ = std::move(leaks);
  }
  stop_everything(graceful ? "shut down" : "shut down without waiting");
  if (error) std::rethrow_exception(error);
}

std::vector<std::string> RpcAgent::leaked_rrefs() const {
  std::lock_guard<std::mutex> lock(leaks_mu_);
  return leaked_;
}

// The order matters: calls fail before their connections close (their errors say the agent
// stopped, not that a connection was lost); connections close before the pool stops (their
// readers post to it); the pool stops before the timeout thread is joined (its timers post).
void RpcAgent::stop_everything(const std::string& reason) {
  if (stopped_.exchange(true)) return;
  if (connections_) connections_->begin_stop();
  if (pending_) pending_->stop(reason);
  if (connections_) connections_->close_all(reason);
  if (dispatcher_) dispatcher_->stop();
  if (pending_) pending_->join();
  if (connections_) connections_->release();
}

}  // namespace tdist::rpc
