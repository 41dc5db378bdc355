// RpcAgent, part 4 of 4: pending calls and timeouts (agent.h has the whole contract; agent.cpp
// lists the parts). Contract of this part:
// - send_request() registers a call under a fresh id (with its deadline when it has a timeout)
//   and the connection it leaves on before sending it, so a response can never arrive for an
//   unknown id, and only a response on that connection completes it; its on_done runs
//   exactly once: with the response (agent_dispatch.cpp), or with the failure: a send or connect
//   that throws (NetworkError; InvalidArgument as is; TimeoutError for a send that stalled past
//   the RPC timeout), a lost connection (fail_pending_to),
//   the deadline (timeout_loop: TimeoutError naming the peer), or the agent stopping.
// - Whoever takes a call out of pending_ counts it in processing_ until its completion ran
//   (complete()), so idle() (no call pending, nothing processing) is never true in between;
//   wait_idle() is what graceful shutdown waits on.
// - timeout_loop() (its own thread) fails calls whose deadline passed and posts the timers of
//   schedule() when they are due; it sleeps until the earliest of both. A new deadline or timer
//   wakes it only when it comes before the thread's next wake-up (timeout_wakes_at_): the
//   deadline of a call that completed is not taken out of its sleep, so in a run of calls one
//   after another each call's deadline comes after the one the thread sleeps until, and no call
//   pays for waking it (a futex wake and a thread switch per call, a fifth of a small call's
//   round trip on two cores).
// Guarded by pending_mu_: pending_, deadlines_, timers_, processing_, stopping_.
#include "tdist/rpc/agent.h"

#include <algorithm>

#include "tdist/core/logging.h"
#include "tdist/rpc/autograd_hooks.h"

namespace tdist::rpc {

using detail::Message;

void RpcAgent::send_request(int to, detail::OutMessage&& m, Millis timeout,
                            detail::ResponseFn on_done, std::string what, bool on_pool) {
  const uint64_t id = next_request_id_.fetch_add(1);
  m.id = id;
  {
    Pending p;
    p.on_done = std::move(on_done);
    p.what = std::move(what);
    p.to = to;
    p.on_pool = on_pool;
    if (timeout.count() > 0) {
      p.has_deadline = true;
      p.deadline = Clock::now() + timeout;
    }
    std::unique_lock<std::mutex> lock(pending_mu_);
    if (stopping_) {
      lock.unlock();
      auto err = std::make_exception_ptr(
          Error(str(p.what, " failed: the RPC agent of worker '", self_.name, "' is shut down")));
      complete(p, nullptr, err);
      return;
    }
    const bool wake = p.has_deadline && p.deadline < timeout_wakes_at_;
    if (p.has_deadline) deadlines_.emplace(p.deadline, id);
    pending_.emplace(id, std::move(p));
    sent_.fetch_add(1);
    if (wake) timeout_cv_.notify_one();
  }
  try {
    if (auto* hooks = autograd_hooks()) hooks->on_send_request(*this, to, m);
    // A call without a timeout still gives up connecting after one handshake timeout.
    auto conn =
        connection_to(to, timeout.count() > 0 ? Clock::now() + timeout
                                              : Clock::now() + conn_options_.handshake.timeout);
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      auto it = pending_.find(id);
      if (it != pending_.end()) it->second.conn = conn;
    }
    conn->send(std::move(m));
  } catch (const std::exception& e) {
    Pending p;
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      auto it = pending_.find(id);
      if (it == pending_.end()) return;  // already failed by the connection's close
      p = std::move(it->second);
      pending_.erase(it);
      if (p.has_deadline) deadlines_.erase({p.deadline, id});
      sent_.fetch_sub(1);
      ++processing_;
    }
    std::exception_ptr err;
    if (dynamic_cast<const InvalidArgument*>(&e)) {
      err = std::current_exception();
    } else if (dynamic_cast<const TimeoutError*>(&e)) {
      // A send stalled past the RPC timeout (a peer that stopped reading): the same kind of
      // error as the call's own deadline, which expires at about the same moment.
      err = std::make_exception_ptr(TimeoutError(str(p.what, " failed: ", e.what())));
    } else {
      err = std::make_exception_ptr(NetworkError(str(p.what, " failed: ", e.what())));
    }
    complete(p, nullptr, err);
  }
}

void RpcAgent::complete(Pending& p, Message* msg, std::exception_ptr error) {
  try {
    p.on_done(msg, std::move(error));
  } catch (const std::exception& e) {
    TDIST_LOG_ERROR("rpc: completion of ", p.what, " threw: ", e.what());
  }
  p.on_done = nullptr;
  std::lock_guard<std::mutex> lock(pending_mu_);
  if (--processing_ == 0 && pending_.empty()) idle_cv_.notify_all();
}

void RpcAgent::schedule(Clock::time_point when, std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    if (stopping_) return;
    timers_.emplace(when, std::move(fn));
    if (when >= timeout_wakes_at_) return;
  }
  timeout_cv_.notify_one();
}

bool RpcAgent::idle() const {
  std::lock_guard<std::mutex> lock(pending_mu_);
  return pending_.empty() && processing_ == 0;
}

size_t RpcAgent::num_pending() const {
  std::lock_guard<std::mutex> lock(pending_mu_);
  return pending_.size();
}

void RpcAgent::fail_pending_to(int rank, const std::string& reason) {
  std::vector<Pending> failed;
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    const std::weak_ptr<detail::Connection> none;
    for (auto it = pending_.begin(); it != pending_.end();) {
      // Only the calls that left on a closed connection: a call still connecting, or sent on a
      // newer connection (a connection that closed before its first frame is made again), is
      // not this close's to fail.
      const auto& w = it->second.conn;
      const bool connecting = !w.owner_before(none) && !none.owner_before(w);
      auto c = w.lock();
      if (it->second.to == rank && !connecting && (!c || c->closed())) {
        if (it->second.has_deadline) deadlines_.erase({it->second.deadline, it->first});
        failed.push_back(std::move(it->second));
        it = pending_.erase(it);
        ++processing_;
      } else {
        ++it;
      }
    }
  }
  if (failed.empty()) return;
  TDIST_LOG_WARN("rpc: connection to ", peer_name(rank), " lost (", reason, "); failing ",
                 failed.size(), " pending calls");
  for (auto& p : failed) {
    auto err = std::make_exception_ptr(
        NetworkError(str(p.what, " failed: connection to ", peer_name(rank), " lost: ", reason)));
    auto shared = std::make_shared<Pending>(std::move(p));
    if (!post_to_pool([this, shared, err] { complete(*shared, nullptr, err); })) {
      complete(*shared, nullptr, err);
    }
  }
}

void RpcAgent::timeout_loop() {
  std::unique_lock<std::mutex> lock(pending_mu_);
  auto sleep_until = [&](Clock::time_point until) {
    timeout_wakes_at_ = until;
    if (until == Clock::time_point::max()) {
      timeout_cv_.wait(lock);
    } else {
      timeout_cv_.wait_until(lock, until);
    }
    timeout_wakes_at_ = Clock::time_point::min();  // awake: it looks at everything before sleeping
  };
  while (!stopping_) {
    if (!timers_.empty() && timers_.begin()->first <= Clock::now()) {
      auto fn = std::move(timers_.begin()->second);
      timers_.erase(timers_.begin());
      lock.unlock();
      post_work(std::move(fn));
      lock.lock();
      continue;
    }
    if (deadlines_.empty()) {
      sleep_until(timers_.empty() ? Clock::time_point::max() : timers_.begin()->first);
      continue;
    }
    auto [deadline, id] = *deadlines_.begin();
    if (Clock::now() < deadline) {
      auto until = deadline;
      if (!timers_.empty()) until = std::min(until, timers_.begin()->first);
      sleep_until(until);
      continue;
    }
    deadlines_.erase(deadlines_.begin());
    auto it = pending_.find(id);
    if (it == pending_.end()) continue;
    Pending p = std::move(it->second);
    pending_.erase(it);
    ++processing_;
    lock.unlock();
    auto err = std::make_exception_ptr(TimeoutError(
        str(p.what, " timed out: no answer from ", peer_name(p.to), " within the call's timeout")));
    complete(p, nullptr, err);
    lock.lock();
  }
}

bool RpcAgent::wait_idle(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(pending_mu_);
  return idle_cv_.wait_until(lock, deadline, [&] { return pending_.empty() && processing_ == 0; });
}

}  // namespace tdist::rpc
