#pragma once
// The completions of REMOTE_CALL and RREF_METHOD_REMOTE requests (rpc/rref.h's remote() and
// RRef<T>::remote()): what the caller does with the owner's answer (Note [RRef protocol] in
// rpc/detail/rref_context.h).

#include <exception>
#include <memory>
#include <string>
#include <utility>

#include "tdist/core/serialize.h"
#include "tdist/rpc/detail/response.h"
#include "tdist/rpc/detail/rref_context.h"
#include "tdist/rpc/errors.h"

namespace tdist::rpc::detail {

// The answer to REMOTE_CALL / RREF_METHOD_REMOTE for a user RRef: confirms it (the owner
// registered the fork even when the call failed) and records the call's error.
inline ResponseFn remote_user_handler(std::weak_ptr<RRefContext> ctx, ForkId fork,
                                      std::string worker, std::string what,
                                      std::shared_ptr<RRefBase> keep_alive = nullptr) {
  return [ctx, fork, worker, what, keep_alive](Message* msg, std::exception_ptr error) {
    auto c = ctx.lock();
    if (!c) return;
    if (error) {
      c->finish_pending_user(fork, false, error);
      return;
    }
    std::exception_ptr call_error;
    try {
      auto remote_error = decode<std::string>(msg->body);
      if (!remote_error.empty()) {
        call_error = std::make_exception_ptr(RemoteError(
            str(what, " failed on worker '", worker, "': ", remote_error), worker, remote_error));
      }
    } catch (...) {
      call_error = std::current_exception();
    }
    c->finish_pending_user(fork, true, call_error);
  };
}

// The answer for an OwnerRRef created here by remote() to ourselves: only failures to deliver
// matter (the handler sets the value or error itself).
inline ResponseFn remote_owner_handler(std::shared_ptr<OwnerRRef> owner,
                                       std::shared_ptr<RRefBase> keep_alive = nullptr) {
  return [owner, keep_alive](Message*, std::exception_ptr error) {
    if (error) owner->set_error(error);
  };
}

}  // namespace tdist::rpc::detail
