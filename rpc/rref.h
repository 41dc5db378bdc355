#pragma once
// RRef<T>: a reference to a value of type T that lives on one worker (its owner), usable from any
// worker. Obtained from remote<T>(...), from make_rref(value) (a value owned here), or received
// as an argument or result of a call. Copies of an RRef<T> share one reference; the value is
// freed on its owner when the last reference anywhere is gone (Note [RRef protocol]).
//
//   RRef<Counter> c = remote<Counter>("ps", "Counter", int64_t{0});
//   c.rpc_sync<int64_t>("add", int64_t{5});     // runs Counter::add on the owner
//   RRef<int64_t> v = c.remote<int64_t>("get"); // result stays on the owner
//   int64_t x = v.to_here();                    // copies the value here
//
// Thread safety: an RRef<T> object is like a shared_ptr (distinct copies may be used from
// different threads). Methods of one owned object may run concurrently on the owner's worker
// threads: the object must be safe for that, or callers must not overlap their calls.

#include <memory>
#include <string>
#include <utility>

#include "tdist/rpc/agent.h"
#include "tdist/rpc/detail/rref_handlers.h"

namespace tdist::rpc {

template <class T>
class RRef {
 public:
  using value_type = T;

  RRef() = default;
  explicit RRef(std::shared_ptr<detail::RRefBase> impl) : impl_(std::move(impl)) {}

  bool valid() const { return impl_ != nullptr; }
  bool is_owner() const { return base().is_owner(); }
  int owner() const { return base().owner(); }
  WorkerInfo owner_info() const { return base().agent()->worker_info(owner()); }
  std::string owner_name() const { return owner_info().name; }
  // True once the owner is known to have registered this reference (always on the owner).
  bool confirmed_by_owner() const { return base().confirmed(); }
  const RRefId& id() const { return base().id(); }

  // A copy of the value, fetched from the owner. Timeout: negative = rpc_timeout, 0 = none.
  Future<T> to_here_async(Millis timeout = Millis(-1)) const;
  T to_here(Millis timeout = Millis(-1)) const {
    auto f = to_here_async(timeout);
    if (is_owner()) f.wait(effective(timeout));
    return f.value();
  }

  // The value itself; only on the owner (InvalidArgument elsewhere). Waits up to rpc_timeout for
  // a value still being created.
  std::shared_ptr<T> local_value() const;

  // Calls a registered method of T on the owner (see Registry::method).
  template <class R, class... A>
  Future<R> rpc_async(const std::string& method, Timeout timeout, A&&... args) const;
  template <class R, class... A>
  Future<R> rpc_async(const std::string& method, A&&... args) const {
    return rpc_async<R>(method, Timeout{}, std::forward<A>(args)...);
  }
  template <class R, class... A>
  R rpc_sync(const std::string& method, A&&... args) const {
    auto f = rpc_async<R>(method, std::forward<A>(args)...);
    if constexpr (std::is_void_v<R>) {
      f.wait();
    } else {
      return f.value();
    }
  }
  // Runs a method on the owner and keeps its result there, as a new RRef.
  template <class R, class... A>
  RRef<R> remote(const std::string& method, A&&... args) const;

  const std::shared_ptr<detail::RRefBase>& impl() const { return impl_; }

  // cereal (the RPC archives only): sending an RRef forks it, receiving one joins the protocol.
  void save(detail::ArgOutputArchive& ar) const;
  void load(detail::ArgInputArchive& ar);

 private:
  const detail::RRefBase& base() const {
    TDIST_CHECK_ARG(impl_ != nullptr, "use of an empty RRef");
    return *impl_;
  }
  // A call from the owner to itself registers a fork that the handler removes once it holds
  // the OwnerRRef, so that the owner's registry knows the RRef while the call is on its way.
  ForkId phantom_fork(RpcAgent& agent) const {
    if (!impl_->is_owner()) return ForkId{};
    return agent.rref_context().prepare_child_fork(impl_, agent.rank()).fork_id;
  }
  Millis effective(Millis timeout) const {
    return timeout.count() >= 0 ? timeout : base().agent()->options().rpc_timeout;
  }

  std::shared_ptr<detail::RRefBase> impl_;
};

template <class T>
struct TypeName<RRef<T>> {
  static std::string name() { return "RRef<" + type_name<T>() + ">"; }
};

// An RRef owning `value` on the calling thread's current agent (rpc/api.h), or on `agent`.
template <class T>
RRef<std::decay_t<T>> make_rref(const std::shared_ptr<RpcAgent>& agent, T&& value) {
  using V = std::decay_t<T>;
  auto owner = agent->rref_context().create_owner(&detail::type_info_of<V>(), false);
  owner->set_value(
      detail::AnyValue{std::make_shared<V>(std::forward<T>(value)), &detail::type_info_of<V>()});
  return RRef<V>(owner);
}

// ---- implementation ----

template <class T>
Future<T> RRef<T>::to_here_async(Millis timeout) const {
  auto agent = base().agent();
  Future<T> fut;
  if (impl_->is_owner()) {
    auto owner = std::static_pointer_cast<detail::OwnerRRef>(impl_);
    owner->when_ready([fut, owner] {
      try {
        detail::AnyValue v = owner->value();
        if (!v.type || v.type->hash != detail::type_info_of<T>().hash) {
          throw InvalidArgument(str("RRef holds ", v.type ? v.type->name : std::string("nothing"),
                                    ", not ", type_name<T>()));
        }
        fut.set_value(*std::static_pointer_cast<T>(v.ptr));
      } catch (...) {
        fut.set_error(std::current_exception());
      }
    });
    return fut;
  }
  auto user = std::static_pointer_cast<detail::UserRRef>(impl_);
  if (auto err = user->creation_error()) {
    fut.set_error(err);
    return fut;
  }
  const auto& ti = detail::type_info_of<T>();
  auto m = detail::encode_message(detail::MessageType::kRRefFetch, &agent->rref_context(), owner(),
                                  std::make_tuple(impl_->id(), ti.hash, ti.name));
  std::string what = str("to_here() of RRef ", impl_->id().str(), " from worker '",
                         agent->worker_info(owner()).name, "'");
  fut.set_description(what);
  agent->send_request(
      owner(), std::move(m), agent->call_timeout(Timeout{timeout}),
      detail::result_handler<T>(fut, agent->rref_context_ptr(), agent->executor(), impl_),
      std::move(what));
  return fut;
}

template <class T>
std::shared_ptr<T> RRef<T>::local_value() const {
  TDIST_CHECK_ARG(is_owner(), "local_value() of RRef ", id().str(),
                  " called on a user; only its owner (rank ", owner(), ") holds the value");
  auto owner = std::static_pointer_cast<detail::OwnerRRef>(impl_);
  detail::AnyValue v = owner->wait(base().agent()->options().rpc_timeout);
  TDIST_CHECK_ARG(v.type && v.type->hash == detail::type_info_of<T>().hash, "RRef holds ",
                  v.type ? v.type->name : std::string("nothing"), ", not ", type_name<T>());
  return std::static_pointer_cast<T>(v.ptr);
}

template <class T>
template <class R, class... A>
Future<R> RRef<T>::rpc_async(const std::string& method, Timeout timeout, A&&... args) const {
  auto agent = base().agent();
  const Signature& sig = signature_of<R, wire_t<A>...>();
  Future<R> fut;
  auto m = detail::encode_message(
      detail::MessageType::kRRefMethodCall, &agent->rref_context(), owner(),
      std::make_tuple(detail::CallHeader{method, sig.hash}, impl_->id(), phantom_fork(*agent)),
      wire_arg(std::forward<A>(args))...);
  std::string what = str("method '", method, "' as ", sig.text, " of RRef ", impl_->id().str(),
                         " on worker '", agent->worker_info(owner()).name, "'");
  fut.set_description(what);
  agent->send_request(
      owner(), std::move(m), agent->call_timeout(timeout),
      detail::result_handler<R>(fut, agent->rref_context_ptr(), agent->executor(), impl_),
      std::move(what));
  return fut;
}

template <class T>
template <class R, class... A>
RRef<R> RRef<T>::remote(const std::string& method, A&&... args) const {
  auto agent = base().agent();
  auto& ctx = agent->rref_context();
  const Signature& sig = signature_of<R, wire_t<A>...>();
  const int dest = owner();
  std::string what =
      str("remote method '", method, "' as ", sig.text, " of RRef ", impl_->id().str());
  if (dest == agent->rank()) {
    auto result = ctx.create_owner(&detail::type_info_of<R>(), true);
    auto m = detail::encode_message(
        detail::MessageType::kRRefMethodRemote, &ctx, dest,
        std::make_tuple(detail::CallHeader{method, sig.hash}, impl_->id(), phantom_fork(*agent),
                        result->id(), ForkId{}, result->secret()),
        wire_arg(std::forward<A>(args))...);
    agent->send_request(dest, std::move(m), agent->options().rpc_timeout,
                        detail::remote_owner_handler(result, impl_), std::move(what), true);
    return RRef<R>(result);
  }
  auto user = ctx.create_user_for_remote(dest, &detail::type_info_of<R>());
  auto m =
      detail::encode_message(detail::MessageType::kRRefMethodRemote, &ctx, dest,
                             std::make_tuple(detail::CallHeader{method, sig.hash}, impl_->id(),
                                             ForkId{}, user->id(), user->fork_id(), user->secret()),
                             wire_arg(std::forward<A>(args))...);
  auto handler = detail::remote_user_handler(agent->rref_context_ptr(), user->fork_id(),
                                             agent->worker_info(dest).name, what, impl_);
  agent->send_request(dest, std::move(m), agent->options().rpc_timeout, std::move(handler),
                      std::move(what), true);
  return RRef<R>(user);
}

template <class T, class... A>
RRef<T> RpcAgent::remote(const To& to, const std::string& fn, Timeout timeout, A&&... args) {
  const int dest = resolve(to);
  const Signature& sig = signature_of<T, wire_t<A>...>();
  std::string what =
      str("remote '", fn, "' as ", sig.text, " on worker '", workers()[dest].name, "'");
  if (dest == rank()) {
    auto owner = rrefs_->create_owner(&detail::type_info_of<T>(), true);
    auto m = detail::encode_message(
        detail::MessageType::kRemoteCall, rrefs_.get(), dest,
        std::make_tuple(detail::CallHeader{fn, sig.hash}, owner->id(), ForkId{}, owner->secret()),
        wire_arg(std::forward<A>(args))...);
    send_request(dest, std::move(m), call_timeout(timeout), detail::remote_owner_handler(owner),
                 std::move(what), true);
    return RRef<T>(owner);
  }
  auto user = rrefs_->create_user_for_remote(dest, &detail::type_info_of<T>());
  auto m = detail::encode_message(detail::MessageType::kRemoteCall, rrefs_.get(), dest,
                                  std::make_tuple(detail::CallHeader{fn, sig.hash}, user->id(),
                                                  user->fork_id(), user->secret()),
                                  wire_arg(std::forward<A>(args))...);
  auto handler = detail::remote_user_handler(rrefs_, user->fork_id(), workers()[dest].name, what);
  send_request(dest, std::move(m), call_timeout(timeout), std::move(handler), std::move(what),
               true);
  return RRef<T>(user);
}

template <class T>
void RRef<T>::save(detail::ArgOutputArchive& ar) const {
  TDIST_CHECK_ARG(impl_ != nullptr, "cannot send an empty RRef");
  auto& sc = ar.context();
  auto ctx = impl_->context();
  TDIST_CHECK_ARG(ctx.get() == sc.rrefs, "RRef ", impl_->id().str(),
                  " belongs to another RPC agent than the one sending it");
  detail::ForkData fd = sc.rrefs->prepare_child_fork(impl_, sc.dest_rank);
  sc.has_rrefs = true;
  ar(fd);
}

template <class T>
void RRef<T>::load(detail::ArgInputArchive& ar) {
  detail::ForkData fd;
  ar(fd);
  auto& rc = ar.context();
  TDIST_CHECK(rc.rrefs != nullptr, "an RRef can only be received by an RPC agent");
  impl_ = rc.rrefs->rref_from_fork(fd, rc.from_rank, &detail::type_info_of<T>());
  if (fd.type_hash != 0 && fd.type_hash != detail::type_info_of<T>().hash) {
    throw InvalidArgument(str("received an RRef of ", fd.type_name, " where RRef<", type_name<T>(),
                              "> was expected"));
  }
}

}  // namespace tdist::rpc
