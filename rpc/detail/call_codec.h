#pragma once
// How the agent's calls are written and their results read: the request's fields with the core
// archive, then the arguments with the RPC archive (tensors become indices into the message's
// tensor list, RRefs their fork data: rpc/detail/archive.h); result_handler() turns a response
// into the value or error of the caller's Future.

#include <exception>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#include "tdist/core/serialize.h"
#include "tdist/rpc/detail/archive.h"
#include "tdist/rpc/detail/callable.h"
#include "tdist/rpc/detail/message.h"
#include "tdist/rpc/detail/response.h"
#include "tdist/rpc/detail/rref_context.h"
#include "tdist/rpc/future.h"

namespace tdist::rpc::detail {

template <class... Fields>
void write_fields(Bytes& body, const Fields&... fields) {
  BytesOutputArchive ar(body);
  ar(fields...);
}

// Encodes a message: core-archive fields, then arguments with the RPC archive.
template <class FieldsTuple, class... A>
OutMessage encode_message(MessageType type, RRefContext* rrefs, int dest, const FieldsTuple& fields,
                          const A&... args) {
  OutMessage m;
  m.type = type;
  std::apply([&](const auto&... f) { write_fields(m.body, f...); }, fields);
  SendContext sc;
  sc.tensors = &m.tensors;
  sc.rrefs = rrefs;
  sc.dest_rank = dest;
  if constexpr (sizeof...(A) > 0) {
    ArgOutputArchive ar(m.body, sc);
    ar(args...);
  }
  if (sc.has_rrefs) m.flags |= kFlagHasRRefs;
  return m;
}

// Decodes a result of type R from a response body.
template <class R>
R decode_result(Message& msg, RRefContext* rrefs) {
  RecvContext rc;
  rc.tensors = &msg.tensors;
  rc.rrefs = rrefs;
  rc.from_rank = msg.from;
  ArgInputArchive ar(msg.body.data(), msg.body.size(), rc);
  if constexpr (std::is_void_v<R>) {
    check_all_read(ar, "result");
  } else {
    R value{};
    ar(value);
    check_all_read(ar, "result");
    return value;
  }
}

template <class R>
ResponseFn result_handler(Future<R> fut, std::weak_ptr<RRefContext> rrefs, Executor* executor,
                          std::shared_ptr<RRefBase> keep_alive = nullptr) {
  return [fut, rrefs, executor, keep_alive](Message* msg, std::exception_ptr error) {
    if (error) {
      fut.set_error(error, executor);
      return;
    }
    try {
      auto ctx = rrefs.lock();
      if constexpr (std::is_void_v<R>) {
        decode_result<void>(*msg, ctx.get());
        fut.set_value(executor);
      } else {
        fut.set_value(decode_result<R>(*msg, ctx.get()), executor);
      }
    } catch (...) {
      fut.set_error(std::current_exception(), executor);
    }
  };
}

}  // namespace tdist::rpc::detail
