#include "tdist/rpc/detail/pending_calls.h"

#include <algorithm>

#include "tdist/core/logging.h"

namespace tdist::rpc::detail {

PendingCalls::PendingCalls(std::string self_name, std::function<std::string(int)> peer_name,
                           std::function<bool(std::function<void()>)> post)
    : self_name_(std::move(self_name)), peer_name_(std::move(peer_name)), post_(std::move(post)) {}

PendingCalls::~PendingCalls() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  timeout_cv_.notify_all();
  join();
}

void PendingCalls::start() {
  timeout_thread_ = std::thread([this] { timeout_loop(); });
}

uint64_t PendingCalls::add(int to, Millis timeout, ResponseFn on_done, std::string what,
                           bool on_pool) {
  const uint64_t id = next_id_.fetch_add(1);
  Call p;
  p.on_done = std::move(on_done);
  p.what = std::move(what);
  p.to = to;
  p.on_pool = on_pool;
  if (timeout.count() > 0) {
    p.has_deadline = true;
    p.deadline = Clock::now() + timeout;
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) {
    lock.unlock();
    auto err = std::make_exception_ptr(
        Error(str(p.what, " failed: the RPC agent of worker '", self_name_, "' is shut down")));
    complete(p, nullptr, err);
    return 0;
  }
  const bool wake = p.has_deadline && p.deadline < wakes_at_;
  if (p.has_deadline) deadlines_.emplace(p.deadline, id);
  calls_.emplace(id, std::move(p));
  sent_.fetch_add(1);
  if (wake) timeout_cv_.notify_one();
  return id;
}

void PendingCalls::set_connection(uint64_t id, const std::shared_ptr<Connection>& conn) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(id);
  if (it != calls_.end()) it->second.conn = conn;
}

void PendingCalls::fail_send(uint64_t id, const std::exception& e, std::exception_ptr error) {
  Call p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(id);
    if (it == calls_.end()) return;  // already failed by the connection's close
    p = std::move(it->second);
    calls_.erase(it);
    if (p.has_deadline) deadlines_.erase({p.deadline, id});
    sent_.fetch_sub(1);
    ++in_progress_;
  }
  std::exception_ptr err;
  if (dynamic_cast<const InvalidArgument*>(&e)) {
    err = std::move(error);
  } else if (dynamic_cast<const TimeoutError*>(&e)) {
    // A send stalled past the RPC timeout (a peer that stopped reading): the same kind of
    // error as the call's own deadline, which expires at about the same moment.
    err = std::make_exception_ptr(TimeoutError(str(p.what, " failed: ", e.what())));
  } else {
    err = std::make_exception_ptr(NetworkError(str(p.what, " failed: ", e.what())));
  }
  complete(p, nullptr, err);
}

PendingCalls::Taken PendingCalls::take_response(uint64_t id, const Connection& conn) {
  Taken taken;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(id);
  if (it == calls_.end()) {
    // An id not yet handed out, or an answer on a connection we never sent on, is a stray; a
    // known id was a call that timed out or failed (dropped quietly).
    if (id >= next_id_.load() || !conn.is_outgoing()) {
      taken.stray = "no such request was sent on that connection";
    }
    return taken;
  }
  if (it->second.conn.lock().get() != &conn) {
    taken.stray = str("that request went to ", peer_name_(it->second.to));
    return taken;
  }
  taken.call = std::move(it->second);
  calls_.erase(it);
  if (taken.call->has_deadline) deadlines_.erase({taken.call->deadline, id});
  ++in_progress_;
  return taken;
}

void PendingCalls::complete(Call& p, Message* msg, std::exception_ptr error) {
  try {
    p.on_done(msg, std::move(error));
  } catch (const std::exception& e) {
    TDIST_LOG_ERROR("rpc: completion of ", p.what, " threw: ", e.what());
  }
  p.on_done = nullptr;
  leave();
}

void PendingCalls::fail_lost(int rank, const std::string& reason) {
  std::vector<Call> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const std::weak_ptr<Connection> none;
    for (auto it = calls_.begin(); it != calls_.end();) {
      // Only the calls that left on a closed connection: a call still connecting, or sent on a
      // newer connection (a connection that closed before its first frame is made again), is
      // not this close's to fail.
      const auto& w = it->second.conn;
      const bool connecting = !w.owner_before(none) && !none.owner_before(w);
      auto c = w.lock();
      if (it->second.to == rank && !connecting && (!c || c->closed())) {
        if (it->second.has_deadline) deadlines_.erase({it->second.deadline, it->first});
        failed.push_back(std::move(it->second));
        it = calls_.erase(it);
        ++in_progress_;
      } else {
        ++it;
      }
    }
  }
  if (failed.empty()) return;
  TDIST_LOG_WARN("rpc: connection to ", peer_name_(rank), " lost (", reason, "); failing ",
                 failed.size(), " pending calls");
  const auto now = Clock::now();
  for (auto& p : failed) {
    // A call past its deadline timed out, whichever of the timeout thread and this close came
    // first (a send that stalls past the RPC timeout closes the connection at about the moment
    // the call's own deadline expires).
    auto err = p.has_deadline && now >= p.deadline
                   ? timed_out(p)
                   : std::make_exception_ptr(NetworkError(str(
                         p.what, " failed: connection to ", peer_name_(rank), " lost: ", reason)));
    auto shared = std::make_shared<Call>(std::move(p));
    if (!post_([this, shared, err] { complete(*shared, nullptr, err); })) {
      complete(*shared, nullptr, err);
    }
  }
}

void PendingCalls::enter() {
  std::lock_guard<std::mutex> lock(mu_);
  ++in_progress_;
}

bool PendingCalls::try_enter() {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return false;
  ++in_progress_;
  return true;
}

void PendingCalls::leave() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--in_progress_ == 0 && calls_.empty()) idle_cv_.notify_all();
}

void PendingCalls::post_work(std::function<void()> fn) {
  if (!try_enter()) return;
  std::function<void()> task = [this, fn = std::move(fn)] {
    try {
      fn();
    } catch (const std::exception& e) {
      TDIST_LOG_ERROR("rpc: worker '", self_name_, "': posted work threw: ", e.what());
    }
    leave();
  };
  if (!post_(std::move(task))) leave();
}

void PendingCalls::schedule(Clock::time_point when, std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    timers_.emplace(when, std::move(fn));
    if (when >= wakes_at_) return;
  }
  timeout_cv_.notify_one();
}

bool PendingCalls::idle() const {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_.empty() && in_progress_ == 0;
}

bool PendingCalls::wait_idle(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  return idle_cv_.wait_until(lock, deadline, [&] { return calls_.empty() && in_progress_ == 0; });
}

size_t PendingCalls::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_.size();
}

std::string PendingCalls::describe_busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string what;
  int shown = 0;
  for (const auto& [id, p] : calls_) {
    if (shown++ == 3) break;
    what += (what.empty() ? "" : "; ") + p.what;
  }
  return str(calls_.size(), " calls pending (", what, "), ", in_progress_,
             " incoming calls running");
}

void PendingCalls::stop(const std::string& reason) {
  std::vector<Call> failed;
  std::multimap<Clock::time_point, std::function<void()>> timers;  // dropped outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    for (auto& [id, p] : calls_) failed.push_back(std::move(p));
    calls_.clear();
    deadlines_.clear();
    timers.swap(timers_);
    in_progress_ += static_cast<int64_t>(failed.size());
  }
  timeout_cv_.notify_all();
  for (auto& p : failed) {
    complete(p, nullptr,
             std::make_exception_ptr(Error(str(p.what, " failed: worker '", self_name_, "' ",
                                               reason, " before it finished"))));
  }
}

void PendingCalls::join() {
  if (timeout_thread_.joinable()) timeout_thread_.join();
}

void PendingCalls::timeout_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  auto sleep_until = [&](Clock::time_point until) {
    wakes_at_ = until;
    if (until == Clock::time_point::max()) {
      timeout_cv_.wait(lock);
    } else {
      timeout_cv_.wait_until(lock, until);
    }
    wakes_at_ = Clock::time_point::min();  // awake: it looks at everything before sleeping
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
    auto it = calls_.find(id);
    if (it == calls_.end()) continue;
    Call p = std::move(it->second);
    calls_.erase(it);
    ++in_progress_;
    lock.unlock();
    complete(p, nullptr, timed_out(p));
    lock.lock();
  }
}

std::exception_ptr PendingCalls::timed_out(const Call& p) const {
  return std::make_exception_ptr(TimeoutError(
      str(p.what, " timed out: no answer from ", peer_name_(p.to), " within the call's timeout")));
}

}  // namespace tdist::rpc::detail
