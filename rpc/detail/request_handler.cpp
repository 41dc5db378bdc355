#include "tdist/rpc/detail/request_handler.h"

#include <exception>

#include "tdist/core/logging.h"
#include "tdist/rpc/agent.h"
#include "tdist/rpc/autograd_hooks.h"

namespace tdist::rpc::detail {
namespace {

// Reads the leading core-archive fields of a request; returns the offset of the arguments.
template <class... Fields>
size_t read_fields(const Message& msg, Fields&... fields) {
  BoundedInputArchive ar(msg.body.data(), msg.body.size());
  try {
    ar(fields...);
  } catch (const cereal::Exception& e) {
    throw ProtocolError(str("malformed ", message_type_name(msg.type), ": ", e.what()));
  }
  return msg.body.size() - ar.remaining();
}

RecvContext recv_context(Message& msg, RRefContext* rrefs) {
  RecvContext rc;
  rc.tensors = &msg.tensors;
  rc.rrefs = rrefs;
  rc.from_rank = msg.from;
  return rc;
}

void check_signature(const std::string& what, const std::string& name, const Signature& have,
                     uint64_t called) {
  if (have.hash != called) {
    throw InvalidArgument(str(what, " '", name, "' is registered here as ", have.text,
                              "; the caller's result or argument types differ"));
  }
}

}  // namespace

RequestHandler::RequestHandler(RpcAgent& agent, WorkerInfo self, std::shared_ptr<RRefContext> rrefs,
                               std::function<bool(std::function<void()>)> post,
                               std::function<std::string(int)> peer_name)
    : agent_(agent),
      self_(std::move(self)),
      rrefs_(std::move(rrefs)),
      post_(std::move(post)),
      peer_name_(std::move(peer_name)) {}

void RequestHandler::handle_request(const std::shared_ptr<Connection>& conn, Message& msg) {
  const uint64_t id = msg.id;
  try {
    switch (msg.type) {
      case MessageType::kCall:
        handle_call(conn, msg);
        return;
      case MessageType::kRemoteCall:
        handle_remote_call(conn, msg);
        return;
      case MessageType::kRRefFetch:
        handle_fetch(conn, msg);
        return;
      case MessageType::kRRefMethodCall:
      case MessageType::kRRefMethodRemote: {
        const bool remote = msg.type == MessageType::kRRefMethodRemote;
        handle_method(conn, std::make_shared<Message>(std::move(msg)), remote);
        return;
      }
      case MessageType::kRRefForkRequest:  // with an autograd header: not on the reader thread
        handle_fork_request(conn, msg);
        return;
      case MessageType::kRRefUserDelete:
      case MessageType::kRRefChildAccept:
        handle_control(conn, msg);
        return;
      default:
        throw ProtocolError(str("unexpected request type ", message_type_name(msg.type)));
    }
  } catch (...) {
    reply_error(conn, id, exception_message(std::current_exception()));
  }
}

void RequestHandler::handle_call(const std::shared_ptr<Connection>& conn, Message& msg) {
  CallHeader h;
  size_t offset = read_fields(msg, h);
  auto fn = registry().find_function(h.name);
  if (!fn) throw InvalidArgument(str("unknown function '", h.name, "' (not registered)"));
  check_signature("function", h.name, fn->signature, h.signature);
  auto rc = recv_context(msg, rrefs_.get());
  ArgInputArchive ar(msg.body.data() + offset, msg.body.size() - offset, rc);
  AnyValue v = fn->invoke(ar);
  reply_value(conn, msg.id, msg.from, v);
}

void RequestHandler::handle_remote_call(const std::shared_ptr<Connection>& conn, Message& msg) {
  CallHeader h;
  RRefId rref_id;
  ForkId fork_id;
  RRefSecret secret;
  size_t offset = read_fields(msg, h, rref_id, fork_id, secret);
  rrefs_->check_new_rref(rref_id, fork_id, msg.from);           // Note [RRef protocol] invariant 7
  auto owner = rrefs_->create_owner_for_call(rref_id, secret);  // invariant 8
  if (fork_id.created_on >= 0 && !rrefs_->add_fork(rref_id, fork_id, msg.from)) {
    throw InvalidArgument(
        str("fork ", fork_id.str(), " of RRef ", rref_id.str(), " is held by another worker"));
  }
  std::string error;
  try {
    auto fn = registry().find_function(h.name);
    if (!fn) throw InvalidArgument(str("unknown function '", h.name, "' (not registered)"));
    check_signature("function", h.name, fn->signature, h.signature);
    auto rc = recv_context(msg, rrefs_.get());
    ArgInputArchive ar(msg.body.data() + offset, msg.body.size() - offset, rc);
    owner->set_value(fn->invoke(ar));
  } catch (...) {
    error = exception_message(std::current_exception());
    owner->set_error(std::make_exception_ptr(
        RemoteError(str("remote '", h.name, "' failed on worker '", self_.name, "': ", error),
                    self_.name, error)));
  }
  rrefs_->owner_ready(rref_id);
  reply_empty(conn, msg.id, encode(error));
}

void RequestHandler::handle_fetch(const std::shared_ptr<Connection>& conn, Message& msg) {
  RRefId rref_id;
  uint64_t type_hash = 0;
  std::string type;
  read_fields(msg, rref_id, type_hash, type);
  auto owner = rrefs_->find_owner(rref_id, nullptr, msg.from);
  if (!owner) {
    throw InvalidArgument(str("to_here(): RRef ", rref_id.str(), " is unknown on its owner (",
                              self_.name, "): it was deleted, or never existed"));
  }
  std::weak_ptr<RpcAgent> weak = agent_.weak_from_this();
  const uint64_t id = msg.id;
  const int from = msg.from;
  // The agent owns this handler: while it lives, so does the handler.
  owner->when_ready([this, weak, conn, owner, id, from, type_hash, type] {
    auto agent = weak.lock();
    if (!agent) return;
    try {
      AnyValue v = owner->value();  // a failed or expired creation's error first
      check_fork_held(owner->id(), from);
      if (!v.type || v.type->hash != type_hash) {
        throw InvalidArgument(str("RRef ", owner->id().str(), " holds ",
                                  v.type ? v.type->name : std::string("nothing"),
                                  " but to_here() asked for ", type));
      }
      reply_value(conn, id, from, v);
    } catch (...) {
      reply_error(conn, id, exception_message(std::current_exception()));
    }
  });
}

void RequestHandler::handle_method(const std::shared_ptr<Connection>& conn,
                                   std::shared_ptr<Message> msg, bool remote) {
  CallHeader h;
  RRefId target;
  ForkId phantom;
  RRefId result_id;
  ForkId result_fork;
  RRefSecret result_secret;
  size_t offset = remote
                      ? read_fields(*msg, h, target, phantom, result_id, result_fork, result_secret)
                      : read_fields(*msg, h, target, phantom);
  std::shared_ptr<OwnerRRef> result;
  if (remote) {
    rrefs_->check_new_rref(result_id, result_fork, msg->from);
    result = rrefs_->create_owner_for_call(result_id, result_secret);
    if (result_fork.created_on >= 0) rrefs_->add_fork(result_id, result_fork, msg->from);
  }
  std::shared_ptr<OwnerRRef> owner;
  std::exception_ptr missing;
  try {
    owner = rrefs_->find_owner(target, nullptr, msg->from);
  } catch (const InvalidArgument&) {
    missing = std::current_exception();  // too many requests waiting (invariant 6)
  }
  if (!owner) {
    // Deleted (invariant 5): a failed stand-in answers like a target whose creation failed.
    owner = std::make_shared<OwnerRRef>(rrefs_, target, self_.rank, nullptr);
    owner->set_error(missing ? missing
                             : std::make_exception_ptr(InvalidArgument(str(
                                   "RRef ", target.str(),
                                   " is unknown on its owner: it was deleted, or never existed"))));
  }
  if (phantom.created_on >= 0) {
    rrefs_->delete_fork(target, phantom, msg->from);  // see RRef::phantom_fork
  }
  std::weak_ptr<RpcAgent> weak = agent_.weak_from_this();
  // Runs once the target's value exists (at once when it does; otherwise on the thread that
  // sets it, see Note [RRef protocol] invariant 5). The agent owns this handler.
  owner->when_ready([this, weak, conn, msg, h, offset, owner, result, result_id, remote] {
    auto agent = weak.lock();
    if (!agent) return;
    std::string error;
    AnyValue value;
    try {
      AnyValue obj = owner->value();
      check_fork_held(owner->id(), msg->from);
      if (!obj.ptr || !obj.type) throw InvalidArgument("the RRef holds no object");
      auto m = registry().find_method(obj.type->hash, h.name);
      if (!m) {
        throw InvalidArgument(
            str("unknown method '", h.name, "' of ", obj.type->name, " (not registered)"));
      }
      check_signature("method", h.name, m->signature, h.signature);
      auto rc = recv_context(*msg, rrefs_.get());
      ArgInputArchive ar(msg->body.data() + offset, msg->body.size() - offset, rc);
      value = m->invoke(obj.ptr.get(), ar);
    } catch (...) {
      error = exception_message(std::current_exception());
    }
    if (!remote) {
      if (error.empty()) {
        try {
          reply_value(conn, msg->id, msg->from, value);
          return;
        } catch (...) {
          error = exception_message(std::current_exception());
        }
      }
      reply_error(conn, msg->id, error);
      return;
    }
    if (error.empty()) {
      result->set_value(std::move(value));
    } else {
      result->set_error(std::make_exception_ptr(RemoteError(
          str("remote method '", h.name, "' failed on worker '", self_.name, "': ", error),
          self_.name, error)));
    }
    rrefs_->owner_ready(result_id);
    reply_empty(conn, msg->id, encode(error));
  });
}

void RequestHandler::check_fork_held(const RRefId& id, int from) const {
  if (from == self_.rank || rrefs_->holds_fork(id, from)) return;
  throw InvalidArgument(str("worker rank ", from, " holds no fork of RRef ", id.str(),
                            " (refused: only a holder may read it or call its methods)"));
}

// On the connection's reader thread (rpc/detail/dispatcher.h), so that the fork is registered before
// the requests read after it run (Note [RRef protocol] invariant 7); the answer goes out from
// the pool.
void RequestHandler::handle_fork_request(const std::shared_ptr<Connection>& conn,
                                         const Message& msg) {
  std::weak_ptr<RpcAgent> weak = agent_.weak_from_this();
  const uint64_t request = msg.id;
  // The agent owns this handler; each pool task holds the agent (Dispatcher::post).
  auto reply = [this, weak, conn, request](std::exception_ptr error) {
    auto agent = weak.lock();
    if (!agent) return;
    post_([this, conn, request, error] {
      try {
        if (error) {
          reply_error(conn, request, exception_message(error));
        } else {
          reply_empty(conn, request);
        }
      } catch (const std::exception& e) {
        TDIST_LOG_DEBUG("rpc: cannot answer RREF_FORK_REQUEST ", request, ": ", e.what());
      }
    });
  };
  try {
    auto [id, fork, secret] = decode<std::tuple<RRefId, ForkId, RRefSecret>>(msg.body);
    // Answered once the RRef is known here, or with an error (Note [RRef protocol]; the secret:
    // invariant 8).
    rrefs_->add_fork_when_known(id, fork, msg.from, secret, reply);
  } catch (...) {
    reply(std::current_exception());
  }
}

void RequestHandler::handle_control(const std::shared_ptr<Connection>& conn, Message& msg) {
  switch (msg.type) {
    case MessageType::kRRefUserDelete: {
      auto [id, fork] = decode<std::tuple<RRefId, ForkId>>(msg.body);
      if (!rrefs_->delete_fork(id, fork, msg.from)) {
        TDIST_LOG_WARN("rpc: worker '", self_.name, "' ignored RREF_USER_DELETE of fork ",
                       fork.str(), " of RRef ", id.str(), " from ", peer_name_(msg.from),
                       ", which does not hold it");
        throw InvalidArgument(str("fork ", fork.str(), " of RRef ", id.str(),
                                  " is not held by worker rank ", msg.from));
      }
      break;
    }
    case MessageType::kRRefChildAccept: {
      auto fork = decode<ForkId>(msg.body);
      if (!rrefs_->child_accepted(fork, msg.from)) {
        throw InvalidArgument(
            str("child fork ", fork.str(), " was not sent to worker rank ", msg.from));
      }
      break;
    }
    default:
      throw ProtocolError("not a control message");
  }
  reply_empty(conn, msg.id);
}

void RequestHandler::reply_value(const std::shared_ptr<Connection>& conn, uint64_t id, int to,
                                 const AnyValue& value) {
  OutMessage r;
  r.type = MessageType::kResponse;
  r.id = id;
  if (value.ptr) {
    if (!value.type || !value.type->encode) {
      throw InvalidArgument(str("a value of type ", value.type ? value.type->name : "?",
                                " cannot be sent: it has no cereal serialize()"));
    }
    SendContext sc;
    sc.tensors = &r.tensors;
    sc.rrefs = rrefs_.get();
    sc.dest_rank = to;
    ArgOutputArchive ar(r.body, sc);
    value.type->encode(value.ptr.get(), ar);
    if (sc.has_rrefs) r.flags |= kFlagHasRRefs;
  }
  send_reply(conn, std::move(r));
}

void RequestHandler::reply_empty(const std::shared_ptr<Connection>& conn, uint64_t id, Bytes body) {
  OutMessage r;
  r.type = MessageType::kResponse;
  r.id = id;
  r.body = std::move(body);
  send_reply(conn, std::move(r));
}

void RequestHandler::reply_error(const std::shared_ptr<Connection>& conn, uint64_t id,
                                 const std::string& message) {
  OutMessage r;
  r.type = MessageType::kError;
  r.id = id;
  r.body = encode(ErrorBody{message, self_.name});
  send_reply(conn, std::move(r));
}

void RequestHandler::send_reply(const std::shared_ptr<Connection>& conn, OutMessage&& m) {
  try {
    if (auto* hooks = autograd_hooks()) {
      try {
        hooks->on_send_response(agent_, conn->peer_rank(), m);
      } catch (const std::exception& e) {
        throw InvalidArgument(e.what());  // answered with an error instead
      }
    }
    conn->send(std::move(m));
  } catch (const InvalidArgument&) {
    throw;  // e.g. a result larger than the maximum frame: the caller gets an error instead
  } catch (const std::exception& e) {
    TDIST_LOG_DEBUG("rpc: cannot answer worker rank ", conn->peer_rank(), ": ", e.what());
  }
}

}  // namespace tdist::rpc::detail
