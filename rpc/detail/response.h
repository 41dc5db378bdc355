#pragma once
// The completion of an outgoing request: called exactly once, with the response (error ==
// nullptr) or with the request's failure.

#include <exception>
#include <functional>

#include "tdist/rpc/message.h"

namespace tdist::rpc::detail {

using ResponseFn = std::function<void(Message* response, std::exception_ptr error)>;

}  // namespace tdist::rpc::detail
