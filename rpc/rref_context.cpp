#include "tdist/rpc/rref_context.h"

#include "tdist/core/logging.h"
#include "tdist/rpc/agent.h"

namespace tdist::rpc::detail {

std::shared_ptr<RpcAgent> RRefBase::agent() const {
  auto ctx = ctx_.lock();
  std::shared_ptr<RpcAgent> a = ctx ? ctx->agent() : nullptr;
  if (!a || a->is_shut_down()) {
    throw Error(str("the RPC agent of the RRef ", id_.str(), " is shut down"));
  }
  return a;
}

// ---- OwnerRRef ----

void OwnerRRef::set_value(AnyValue v) {
  std::vector<std::function<void()>> waiters;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ready_) return;
    value_ = std::move(v);
    ready_ = true;
    waiters.swap(waiters_);
  }
  cv_.notify_all();
  for (auto& w : waiters) w();
}

void OwnerRRef::set_error(std::exception_ptr e) {
  std::vector<std::function<void()>> waiters;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ready_) return;
    error_ = std::move(e);
    ready_ = true;
    waiters.swap(waiters_);
  }
  cv_.notify_all();
  for (auto& w : waiters) w();
}

const TypeInfo* OwnerRRef::type() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ready_ && value_.type ? value_.type : type_;
}

bool OwnerRRef::ready() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ready_;
}

void OwnerRRef::when_ready(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ready_) {
      waiters_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

AnyValue OwnerRRef::wait(Millis timeout) const {
  std::unique_lock<std::mutex> lock(mu_);
  if (timeout.count() > 0) {
    if (!cv_.wait_for(lock, timeout, [&] { return ready_; })) {
      throw TimeoutError(str("waited ", timeout.count(), " ms for the value of RRef ", id_.str(),
                             " on its owner (the call creating it has not finished)"));
    }
  } else {
    cv_.wait(lock, [&] { return ready_; });
  }
  if (error_) std::rethrow_exception(error_);
  return value_;
}

AnyValue OwnerRRef::value() const {
  std::lock_guard<std::mutex> lock(mu_);
  TDIST_CHECK(ready_, "RRef ", id_.str(), " has no value yet");
  if (error_) std::rethrow_exception(error_);
  return value_;
}

// ---- UserRRef ----

UserRRef::UserRRef(std::shared_ptr<RRefContext> ctx, RRefId id, ForkId fork, int owner,
                   const TypeInfo* type)
    : RRefBase(ctx, id, owner, type), strong_ctx_(std::move(ctx)), fork_(fork) {}

UserRRef::~UserRRef() {
  try {
    strong_ctx_->user_deleted(*this);
  } catch (const std::exception& e) {
    TDIST_LOG_WARN("rpc: could not tell the owner that user RRef ", id_.str(), " fork ",
                   fork_.str(), " is gone: ", e.what());
  }
}

std::exception_ptr UserRRef::creation_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return creation_error_;
}

// ---- RRefContext ----

RRefContext::RRefContext(std::weak_ptr<RpcAgent> agent, int rank)
    : agent_(std::move(agent)), rank_(rank) {}

GloballyUniqueId RRefContext::new_id() { return GloballyUniqueId{rank_, next_id_.fetch_add(1)}; }

std::shared_ptr<OwnerRRef> RRefContext::create_owner(const TypeInfo* type, bool registered) {
  auto owner = std::make_shared<OwnerRRef>(weak_from_this(), new_id(), rank_, type);
  if (registered) {
    std::lock_guard<std::mutex> lock(mu_);
    owners_.emplace(owner->id(), owner);
  }
  return owner;
}

std::shared_ptr<OwnerRRef> RRefContext::get_or_create_owner(const RRefId& id,
                                                            const TypeInfo* type) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = owners_[id];
  if (!slot) slot = std::make_shared<OwnerRRef>(weak_from_this(), id, rank_, type);
  return slot;
}

std::shared_ptr<UserRRef> RRefContext::create_user_for_remote(int owner, const TypeInfo* type) {
  auto user = std::make_shared<UserRRef>(shared_from_this(), new_id(), new_id(), owner, type);
  std::lock_guard<std::mutex> lock(mu_);
  pending_users_.emplace(user->fork_id(), user);
  users_.emplace(user->fork_id(), str("user RRef ", user->id().str(), " fork ",
                                      user->fork_id().str(), " of ", type ? type->name : "?",
                                      " owned by rank ", owner));
  return user;
}

void RRefContext::finish_pending_user(const ForkId& fork, bool confirmed,
                                      std::exception_ptr error) {
  std::shared_ptr<UserRRef> user;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_users_.find(fork);
    if (it == pending_users_.end()) return;  // idempotent
    user = std::move(it->second);
    pending_users_.erase(it);
  }
  if (error) {
    std::lock_guard<std::mutex> lock(user->mu_);
    user->creation_error_ = error;
  }
  if (confirmed) user->confirmed_ = true;
  // `user` may be the last reference: its destructor sends the deletion, outside our lock.
}

ForkData RRefContext::prepare_child_fork(const std::shared_ptr<RRefBase>& rref, int dest) {
  (void)dest;
  ForkData fd;
  fd.rref_id = rref->id();
  fd.fork_id = new_id();
  fd.parent = rank_;
  fd.owner = rref->owner();
  if (const TypeInfo* t = rref->type()) {
    fd.type_hash = t->hash;
    fd.type_name = t->name;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (rref->is_owner()) {
    // Early registration: the owner knows the child before it exists.
    owners_.emplace(rref->id(), std::static_pointer_cast<OwnerRRef>(rref));
    forks_[rref->id()].insert(fd.fork_id);
  } else {
    // The parent stays alive until the child is confirmed (invariant 2).
    pending_children_.emplace(fd.fork_id, rref);
  }
  return fd;
}

std::shared_ptr<RRefBase> RRefContext::rref_from_fork(const ForkData& fd, int from,
                                                      const TypeInfo* type) {
  auto agent = agent_.lock();
  const int world = agent ? agent->world_size() : 0;
  if (fd.owner < 0 || fd.owner >= world || fd.parent < 0 || fd.parent >= world ||
      fd.parent != from) {
    throw ProtocolError(str("bad RRef fork data from rank ", from, ": owner ", fd.owner,
                            ", parent ", fd.parent));
  }
  if (fd.owner == rank_) {
    auto owner = get_or_create_owner(fd.rref_id, type);
    if (fd.parent == rank_) {
      delete_fork(fd.rref_id, fd.fork_id);  // the fork added when we sent it to ourselves
    } else {
      send_child_accept(fd.parent, fd.fork_id);
    }
    return owner;
  }
  auto user = std::make_shared<UserRRef>(shared_from_this(), fd.rref_id, fd.fork_id, fd.owner,
                                         type);
  {
    std::lock_guard<std::mutex> lock(mu_);
    users_.emplace(fd.fork_id, str("user RRef ", fd.rref_id.str(), " fork ", fd.fork_id.str(),
                                   " of ", fd.type_name, " owned by rank ", fd.owner));
    if (fd.parent != fd.owner) pending_users_.emplace(fd.fork_id, user);
  }
  if (fd.parent == fd.owner) {
    user->confirmed_ = true;  // the owner registered this fork before sending it
  } else {
    send_fork_request(user, fd.parent);
  }
  return user;
}

void RRefContext::send_fork_request(const std::shared_ptr<UserRRef>& user, int parent) {
  const ForkId fork = user->fork_id();
  auto agent = agent_.lock();
  if (!agent) {
    finish_pending_user(fork, false, nullptr);
    return;
  }
  auto m = encode_message(MessageType::kRRefForkRequest, this, user->owner(),
                          std::make_tuple(user->id(), fork));
  std::weak_ptr<RRefContext> weak = weak_from_this();
  agent->send_request(
      user->owner(), std::move(m), agent->options().rpc_timeout,
      [weak, fork, parent](Message*, std::exception_ptr error) {
        auto ctx = weak.lock();
        if (!ctx) return;
        ctx->finish_pending_user(fork, error == nullptr, error);
        ctx->send_child_accept(parent, fork);
      },
      str("RREF_FORK_REQUEST for RRef ", user->id().str(), " fork ", fork.str()),
      /*on_pool=*/true);
}

void RRefContext::send_child_accept(int parent, const ForkId& fork) {
  if (parent == rank_) {
    child_accepted(fork);
    return;
  }
  auto agent = agent_.lock();
  if (!agent) return;
  auto m = encode_message(MessageType::kRRefChildAccept, this, parent, std::make_tuple(fork));
  agent->send_request(
      parent, std::move(m), agent->options().rpc_timeout,
      [fork](Message*, std::exception_ptr error) {
        if (!error) return;
        try {
          std::rethrow_exception(error);
        } catch (const std::exception& e) {
          TDIST_LOG_WARN("rpc: RREF_CHILD_ACCEPT for fork ", fork.str(), " failed: ", e.what());
        }
      },
      str("RREF_CHILD_ACCEPT for fork ", fork.str()), /*on_pool=*/true);
}

void RRefContext::add_fork(const RRefId& id, const ForkId& fork) {
  std::lock_guard<std::mutex> lock(mu_);
  forks_[id].insert(fork);
}

void RRefContext::delete_fork(const RRefId& id, const ForkId& fork) {
  std::shared_ptr<OwnerRRef> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = forks_.find(id);
    if (it == forks_.end()) return;  // idempotent
    it->second.erase(fork);
    if (!it->second.empty()) return;
    forks_.erase(it);
    auto o = owners_.find(id);
    if (o != owners_.end() && o->second->ready()) {
      dropped = std::move(o->second);
      owners_.erase(o);
    }
  }
  // `dropped` may hold the last reference to the value: freed here, outside the lock.
}

void RRefContext::owner_ready(const RRefId& id) {
  std::shared_ptr<OwnerRRef> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto f = forks_.find(id);
    if (f != forks_.end() && !f->second.empty()) return;
    auto o = owners_.find(id);
    if (o != owners_.end() && o->second->ready()) {
      dropped = std::move(o->second);
      owners_.erase(o);
    }
  }
}

void RRefContext::child_accepted(const ForkId& fork) {
  std::shared_ptr<RRefBase> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_children_.find(fork);
    if (it == pending_children_.end()) return;  // idempotent
    dropped = std::move(it->second);
    pending_children_.erase(it);
  }
}

void RRefContext::user_deleted(const UserRRef& user) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    users_.erase(user.fork_id());
  }
  auto agent = agent_.lock();
  if (!agent || agent->is_shut_down()) return;  // after shutdown: reported as leaked
  const RRefId id = user.id();
  const ForkId fork = user.fork_id();
  auto m = encode_message(MessageType::kRRefUserDelete, this, user.owner(),
                          std::make_tuple(id, fork));
  agent->send_request(
      user.owner(), std::move(m), agent->options().rpc_timeout,
      [id](Message*, std::exception_ptr error) {
        if (!error) return;
        try {
          std::rethrow_exception(error);
        } catch (const std::exception& e) {
          TDIST_LOG_WARN("rpc: RREF_USER_DELETE for RRef ", id.str(), " failed: ", e.what());
        }
      },
      str("RREF_USER_DELETE for RRef ", id.str(), " fork ", fork.str()), /*on_pool=*/true);
}

std::vector<std::string> RRefContext::registered() const {
  std::vector<std::string> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, owner] : owners_) {
    auto f = forks_.find(id);
    size_t n = f == forks_.end() ? 0 : f->second.size();
    const TypeInfo* t = owner->type();
    out.push_back(str("owned RRef ", id.str(), t ? " of " + t->name : std::string(), " with ", n,
                      " user fork(s)", owner->ready() ? "" : " and no value yet"));
  }
  for (const auto& [fork, what] : users_) out.push_back(what);
  for (const auto& [fork, user] : pending_users_) {
    out.push_back(str("pending user fork ", fork.str(), " (owner has not confirmed it)"));
  }
  for (const auto& [fork, parent] : pending_children_) {
    out.push_back(str("pending child fork ", fork.str(), " of RRef ", parent->id().str()));
  }
  return out;
}

size_t RRefContext::num_owned() const {
  std::lock_guard<std::mutex> lock(mu_);
  return owners_.size();
}

size_t RRefContext::num_forks(const RRefId& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto f = forks_.find(id);
  return f == forks_.end() ? 0 : f->second.size();
}

size_t RRefContext::num_pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_users_.size() + pending_children_.size();
}

}  // namespace tdist::rpc::detail
