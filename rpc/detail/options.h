#pragma once
// RpcOptions, resolved: every field a caller set is checked and kept; every field left at its
// "unset" value (0 or -1, as rpc/types.h says per field) takes its TDIST_RPC_* variable, else its
// default. resolve_options is the only place RPC reads the environment (the token aside: it is
// core/token.h's, shared with the store and the mesh); docs/configuration.md has the table.

#include "tdist/rpc/types.h"

namespace tdist::rpc::detail {

// Throws InvalidArgument naming the field when a set value is out of range, or the variable when
// a variable's is.
RpcOptions resolve_options(RpcOptions options);

}  // namespace tdist::rpc::detail
