// RpcAgent, part 1 of 4: its life (agent.h has the whole contract). Here: start() (check the
// options, meet the store, listen, join the group through it: every worker publishes its name and
// address under its incarnation's keys and waits for all), the name/rank directory, and the
// end: shutdown() (Note [RPC graceful shutdown] in agent.h: store rounds of request counts until
// two agree) and stop_everything(), which fails whatever is still pending, closes every
// connection and joins every thread the agent started.
//
// The other parts: agent_connections.cpp (listener, outgoing connections with retry, a peer
// lost), agent_dispatch.cpp (each incoming frame: a request to the worker pool, a response to
// its pending call), agent_pending.cpp (the table of pending calls, their timeouts and timers,
// idleness). Requests are answered in request_handlers.cpp.
#include "tdist/rpc/agent.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include "tdist/core/net/handshake.h"
#include "tdist/core/logging.h"
#include "tdist/core/rendezvous.h"
#include "tdist/core/token.h"
#include "tdist/rpc/api.h"
#include "tdist/rpc/detail/deadline.h"
#include "tdist/rpc/detail/options.h"

namespace tdist::rpc {

using detail::remaining;

namespace {

const std::string kPrefix = "tdist_rpc/";

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

RpcAgent::RpcAgent(const std::string& name, int rank, int world_size, RpcOptions options)
    : options_(std::move(options)) {
  TDIST_CHECK_ARG(world_size > 0, "world_size must be positive, got ", world_size);
  TDIST_CHECK_ARG(rank >= 0 && rank < world_size, "rank ", rank, " is not in [0, ", world_size,
                  ")");
  TDIST_CHECK_ARG(!name.empty(), "a worker needs a name");
  self_.name = name;
  self_.rank = rank;
  options_ = detail::resolve_options(std::move(options_));
  const Millis hs_timeout = options_.handshake_timeout;
  conn_options_.max_frame_bytes = options_.max_frame_bytes;
  conn_options_.max_requests_in_flight = options_.max_requests_in_flight;
  conn_options_.send_timeout = options_.rpc_timeout;
  conn_options_.frame_timeout = options_.rpc_timeout;
  Token token = resolve_token(options_.token, "RpcOptions::token");
  options_.token = token.value;
  token_source_ = token.source;
  conn_options_.handshake.token = *options_.token;
  conn_options_.handshake.my_rank = rank;
  conn_options_.handshake.world_size = world_size;
  conn_options_.handshake.issued = std::make_shared<net::IssuedChallenges>();
  conn_options_.handshake.fast_path = options_.same_host_fast_path;
  conn_options_.handshake.timeout = hs_timeout;
  conn_options_.socket_buffer_bytes = options_.socket_buffer_bytes;
  conn_options_.spin = std::chrono::microseconds(options_.spin_us);
  conn_options_.shm_bytes = static_cast<uint64_t>(options_.shm_bytes);
  conn_options_.stream_bytes = static_cast<uint64_t>(options_.stream_bytes);
  for (int i = 0; i < world_size; ++i) peers_.push_back(std::make_unique<Peer>());
}

std::shared_ptr<RpcAgent> RpcAgent::start(const std::string& name, int rank, int world_size,
                                          RpcOptions options) {
  std::shared_ptr<RpcAgent> a(new RpcAgent(name, rank, world_size, std::move(options)));
  std::weak_ptr<RpcAgent> weak = a;
  a->rrefs_ = std::make_shared<detail::RRefContext>(weak, rank);
  a->pool_ = std::make_unique<detail::ThreadPool>(
      a->options_.num_worker_threads, [weak] { detail::set_thread_agent(weak); },
      std::chrono::microseconds(a->options_.spin_us));
  a->open_store(world_size);
  a->listen();
  a->accept_thread_ = std::thread([raw = a.get()] { raw->accept_loop(); });
  a->timeout_thread_ = std::thread([raw = a.get()] { raw->timeout_loop(); });
  try {
    a->join_group(world_size);
  } catch (...) {
    a->stop_everything("start failed");
    throw;
  }
  TDIST_LOG_INFO("rpc: worker '", name, "' (rank ", rank, " of ", world_size, ") listening on ",
                 a->host_, ":", a->port_,
                 a->options_.token->empty() ? "" : " (token from " + a->token_source_ + ")");
  if (a->options_.token->empty()) {
    TDIST_LOG_WARN("rpc: worker '", name, "': the RPC port ", a->host_, ":", a->port_,
                   " is unauthenticated: anyone who can reach it can call every "
                   "registered function (set TDIST_TOKEN or TDIST_TOKEN_FILE on every worker)");
  }
  return a;
}

RpcAgent::~RpcAgent() { stop_everything("agent destroyed"); }

// Before listen(): the store's host decides the address this worker listens on.
void RpcAgent::open_store(int world_size) {
  if (options_.store) {
    store_ = options_.store;
  } else {
    const Millis timeout =
        options_.rpc_timeout.count() > 0 ? options_.rpc_timeout : Store::kDefaultTimeout;
    store_ = rendezvous(options_.init_method, self_.rank, world_size, timeout).store;
  }
}

void RpcAgent::join_group(int world_size) {
  const Millis timeout =
      options_.rpc_timeout.count() > 0 ? options_.rpc_timeout : Store::kDefaultTimeout;
  // The n-th init_rpc of each rank on one store uses keys of incarnation n, so a store that
  // served an earlier RPC group (same ranks) does not mix the two.
  const int64_t incarnation = store_->add(kPrefix + "incarnation/" + std::to_string(self_.rank), 1);
  store_prefix_ = kPrefix + std::to_string(incarnation) + "/";
  store_->set(store_prefix_ + "worker/" + std::to_string(self_.rank),
              encode(self_.name, host_, port_));
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r)
    keys.push_back(store_prefix_ + "worker/" + std::to_string(r));
  try {
    store_->wait(keys, timeout);
  } catch (const TimeoutError& e) {
    throw TimeoutError(str("worker '", self_.name, "' (rank ", self_.rank, ") waited ",
                           timeout.count(), " ms for all ", world_size,
                           " RPC workers to join: ", e.what()));
  }
  for (int r = 0; r < world_size; ++r) {
    auto fields = decode<std::tuple<std::string, std::string, uint16_t>>(store_->get(keys[r]));
    WorkerInfo w{std::get<0>(fields), r};
    TDIST_CHECK_ARG(rank_by_name_.emplace(w.name, r).second, "worker name '", w.name,
                    "' is used by ranks ", rank_by_name_[w.name], " and ", r);
    workers_.push_back(w);
    addresses_.emplace_back(std::get<1>(fields), std::get<2>(fields));
  }
}

const WorkerInfo& RpcAgent::worker_info(const To& to) const {
  if (to.by_rank()) {
    TDIST_CHECK_ARG(to.rank() < static_cast<int>(workers_.size()), "no RPC worker with rank ",
                    to.rank(), " (world size ", workers_.size(), ")");
    return workers_[to.rank()];
  }
  auto it = rank_by_name_.find(to.name());
  TDIST_CHECK_ARG(it != rank_by_name_.end(), "no RPC worker named '", to.name(), "'");
  return workers_[it->second];
}

std::string RpcAgent::peer_name(int rank) const {
  if (rank >= 0 && rank < static_cast<int>(workers_.size())) {
    return str("worker '", workers_[rank].name, "' (rank ", rank, ")");
  }
  return str("worker rank ", rank);
}

void RpcAgent::publish_lost_peers() {
  std::vector<int> fresh;
  {
    std::lock_guard<std::mutex> lock(lost_mu_);
    for (int r : lost_) {
      if (lost_published_.insert(r).second) fresh.push_back(r);
    }
  }
  for (int r : fresh) {
    // A worker that finished its shutdown closes its connections too: not gone, just left.
    if (store_->check({store_prefix_ + "shutdown/exit/" + std::to_string(r)})) continue;
    TDIST_LOG_WARN("rpc: shutdown: worker '", self_.name, "' lost its connection to ", peer_name(r),
                   "; the other workers' shutdown will not wait for it");
    store_->set(store_prefix_ + "shutdown/gone/" + std::to_string(r), "1");
  }
}

std::vector<bool> RpcAgent::wait_for_workers(const std::string& prefix, int first_rank,
                                             Clock::time_point deadline) {
  static constexpr Millis kPoll{100};
  const int n = world_size();
  const std::string gone = store_prefix_ + "shutdown/gone/";
  std::vector<bool> present(n, false), resolved(n, false);
  for (int r = 0; r < first_rank; ++r) resolved[r] = true;
  for (;;) {
    std::vector<std::string> missing;
    for (int r = 0; r < n; ++r) {
      if (!resolved[r]) missing.push_back(prefix + std::to_string(r));
    }
    try {
      store_->wait(missing, std::min(kPoll, remaining(deadline)));
      for (int r = first_rank; r < n; ++r) present[r] = present[r] || !resolved[r];
      return present;
    } catch (const TimeoutError&) {
      if (Clock::now() >= deadline) {
        std::string who;
        for (int r = first_rank; r < n; ++r) {
          if (!resolved[r]) who += (who.empty() ? "" : ", ") + peer_name(r);
        }
        throw TimeoutError(
            str("no key ", prefix, "<rank> from ", who, ", and none of them was seen gone"));
      }
    }
    publish_lost_peers();
    for (int r = first_rank; r < n; ++r) {
      if (resolved[r]) continue;
      const std::string key = prefix + std::to_string(r);
      if (store_->check({key})) {
        present[r] = resolved[r] = true;
      } else if (store_->check({gone + std::to_string(r)})) {
        // Whatever it set, it set before it was seen gone: one more look decides for good.
        resolved[r] = true;
        present[r] = store_->check({key});
      }
    }
    if (store_->check({gone + std::to_string(self_.rank)})) {
      throw Error(str("worker '", self_.name,
                      "' was declared gone by another worker (a "
                      "connection to it broke) while it was still shutting down"));
    }
  }
}

void RpcAgent::graceful_barrier() {
  const Millis limit =
      options_.shutdown_timeout.count() > 0 ? options_.shutdown_timeout : Millis(1LL << 40);
  const auto deadline = Clock::now() + limit;
  const int n = world_size();
  std::vector<std::pair<int64_t, int64_t>> prev;
  for (int round = 0;; ++round) {
    // Round 0 told everybody that this worker is shutting down; from round 1 on, every worker
    // is, and what they still hold is deleted (Note [RPC graceful shutdown]).
    if (round > 0) rrefs_->delete_all_users();
    if (!wait_idle(deadline)) {
      std::string what;
      {
        std::lock_guard<std::mutex> lock(pending_mu_);
        int shown = 0;
        for (const auto& [id, p] : pending_) {
          if (shown++ == 3) break;
          what += (what.empty() ? "" : "; ") + p.what;
        }
        what = str(pending_.size(), " calls pending (", what, "), ", processing_,
                   " incoming calls running");
      }
      throw TimeoutError(str("shutdown of worker '", self_.name, "' waited ", limit.count(),
                             " ms for its own work to finish: ", what));
    }
    const std::string round_prefix = store_prefix_ + "shutdown/" + std::to_string(round) + "/";
    store_->set(round_prefix + std::to_string(self_.rank), encode(sent_.load(), received_.load()));
    std::vector<bool> present;
    try {
      present = wait_for_workers(round_prefix, 0, deadline);
    } catch (const TimeoutError& e) {
      throw TimeoutError(str("shutdown of worker '", self_.name, "' waited ", limit.count(),
                             " ms for the other workers to shut down (round ", round,
                             "): ", e.what()));
    }
    // A gone worker that never published this round counts as (-1, -1) for everybody alike.
    std::vector<std::pair<int64_t, int64_t>> counts(n, {-1, -1});
    for (int r = 0; r < n; ++r) {
      if (present[r]) {
        counts[r] =
            decode<std::pair<int64_t, int64_t>>(store_->get(round_prefix + std::to_string(r)));
      }
    }
    if (round > 0 && counts == prev) break;
    prev = std::move(counts);
  }
  // The store may live in one of the workers (TCPStore server): leave only when every worker
  // has read the last round.
  store_->set(store_prefix_ + "shutdown/exit/" + std::to_string(self_.rank), "1");
  wait_for_workers(store_prefix_ + "shutdown/exit/", 0, deadline);
  // Rank 0 usually hosts that store (env://): it stays until every other worker's wait above
  // has returned, or an exiting rank 0 could cut another worker's wait off mid-reply. The others'
  // last store call is the "left" mark; its own reply may be cut off, which is harmless.
  const std::string left = store_prefix_ + "shutdown/left/";
  if (self_.rank == 0) {
    try {
      wait_for_workers(left, 1, deadline);
    } catch (const std::exception& e) {
      TDIST_LOG_WARN("rpc: shutdown: not every worker confirmed it left the store: ", e.what());
    }
  } else {
    try {
      store_->set(left + std::to_string(self_.rank), "1");
    } catch (const std::exception&) {}
  }
}

void RpcAgent::shutdown(bool graceful) {
  TDIST_CHECK_ARG(!(graceful && pool_ && pool_->in_pool_thread()), "shutdown() of worker '",
                  self_.name,
                  "' called on one of its own worker "
                  "threads (from a function called over RPC): it would wait for that very call; "
                  "shut down from the program's own thread");
  std::lock_guard<std::mutex> guard(shutdown_mu_);
  if (stopped_.load()) return;
  std::exception_ptr error;
  if (graceful) {
    try {
      graceful_barrier();
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

void RpcAgent::stop_everything(const std::string& reason) {
  std::vector<Pending> failed;
  std::multimap<Clock::time_point, std::function<void()>> timers;  // dropped outside the lock
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    if (stopping_ && stopped_.load()) return;
    stopping_ = true;
    stopped_ = true;
    for (auto& [id, p] : pending_) failed.push_back(std::move(p));
    pending_.clear();
    deadlines_.clear();
    timers.swap(timers_);
    processing_ += static_cast<int64_t>(failed.size());
  }
  timeout_cv_.notify_all();
  for (auto& p : failed) {
    complete(p, nullptr,
             std::make_exception_ptr(Error(str(p.what, " failed: worker '", self_.name, "' ",
                                               reason, " before it finished"))));
  }
  if (listener_) listener_->shutdown();
  if (accept_thread_.joinable()) accept_thread_.join();
  listener_.reset();
  std::vector<std::shared_ptr<detail::Connection>> conns;
  for (auto& p : peers_) {
    std::lock_guard<std::mutex> lock(p->mu);
    if (p->conn) conns.push_back(p->conn);
    if (p->failed.empty()) p->failed = str("the RPC agent of worker '", self_.name, "' ", reason);
  }
  {
    std::lock_guard<std::mutex> lock(conns_mu_);
    for (auto& c : incoming_) conns.push_back(c);
  }
  for (auto& c : conns) c->close(reason);
  for (auto& c : conns) c->join();
  if (pool_) pool_->stop();
  if (timeout_thread_.joinable()) timeout_thread_.join();
  {
    std::lock_guard<std::mutex> lock(conns_mu_);
    incoming_.clear();
  }
  for (auto& p : peers_) {
    std::lock_guard<std::mutex> lock(p->mu);
    p->conn.reset();
  }
}

}  // namespace tdist::rpc
