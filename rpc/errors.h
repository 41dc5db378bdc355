#pragma once
// RPC errors. A call fails with:
//   RemoteError    the function (or constructor, method) raised on the callee, or the callee
//                  refused the call (unknown name, mismatched signature, bad arguments);
//                  carries the callee's message and name
//   TimeoutError   the call's timeout passed without an answer
//   NetworkError   the connection to the callee could not be made or broke (worker died)
// (tdist::TimeoutError / NetworkError from core/error.h.)

#include <string>

#include "tdist/core/error.h"

namespace tdist::rpc {

class RemoteError : public Error {
 public:
  RemoteError(const std::string& what, std::string worker, std::string remote_message)
      : Error(what), worker_(std::move(worker)), remote_message_(std::move(remote_message)) {}
  // The callee's name and its own error message.
  const std::string& worker() const { return worker_; }
  const std::string& remote_message() const { return remote_message_; }

 private:
  std::string worker_;
  std::string remote_message_;
};

}  // namespace tdist::rpc
