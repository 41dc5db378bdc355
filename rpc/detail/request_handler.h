#pragma once
// RequestHandler: what answers the requests the Dispatcher (rpc/detail/dispatcher.h) reads: the
// agent's request handlers (rpc/request_handlers.cpp). Each request gets exactly one answer,
// its result (RESPONSE) or an error (ERROR) naming this worker.

#include <cstdint>
#include <memory>
#include <string>

#include "tdist/rpc/detail/connection.h"
#include "tdist/rpc/detail/message.h"

namespace tdist::rpc::detail {

class RequestHandler {
 public:
  virtual ~RequestHandler() = default;
  // On a worker thread; answers the request or arranges for it to be answered.
  virtual void handle_request(const std::shared_ptr<Connection>& conn, Message& msg) = 0;
  // On the connection's reader thread, in order: registers the fork (Note [RRef protocol]
  // invariant 7); the answer goes out from the pool.
  virtual void handle_fork_request(const std::shared_ptr<Connection>& conn, const Message& msg) = 0;
  // Answers request `id` with an ERROR carrying `message`.
  virtual void reply_error(const std::shared_ptr<Connection>& conn, uint64_t id,
                           const std::string& message) = 0;
};

}  // namespace tdist::rpc::detail
