#pragma once
// The connection handshake: authentication with a shared token, the connecting worker's rank,
// and whether the same-host fast path works between the two processes.
//
// Note [RPC handshake]
// ~~~~~~~~~~~~~~~~~~~~
// Runs on every new connection before any frame is read: the connection handshake shared with
// the store and the mesh (service "RPC", Note [Connection handshake] in core/net/handshake.h),
// with one deadline for all of it (HandshakeOptions::timeout), so a peer that trickles bytes is
// dropped when it passes. RPC's fields, all fixed-size:
//   HELLO    (client) i32 rank | u32 pid | u32 wants the fast path
//   ACCEPT   (server) u32 pid | u32 reads the client's tensors | u32 offers the fast path
//   CONFIRM  (client) u32 reads the server's tensors
// The server also closes the connection when the rank is not in [0, world size). A worker that
// has a token rejects one that has none.
// Busy: a server with too many connections in their handshake closes one whose HELLO has not
// verified yet (RpcOptions::max_pending_handshakes) and writes the 4 bytes "TBSY" first, where
// ACCEPT would come (never after a verified HELLO: that connection is let finish). A client that
// reads them, or whose connection is reset before ACCEPT, retries (NetworkError); a plain close
// after its HELLO is a refusal (ProtocolError: another token), which it does not retry. The
// marker is not authenticated: whoever can close the connection can make the client retry.
//
// Same-host fast path: a receiver may read a sender's large tensors straight from the sender's
// memory (process_vm_readv), and the sender then sends addresses instead of bytes
// (kFlagRemoteTensors). The reading side decides it alone, after the peer authenticated, from
// facts it checks itself (rpc/detail/same_host.h: the peer's end of this connection is a socket
// of our user in our network namespace, held by the process whose pid the peer named, and the
// kernel lets us read that process). The pid a peer names is a hint that this check confirms or
// refutes: a peer naming our own pid (to make us read our own memory into a tensor) or another
// process's fails it. No address or other memory-layout fact is ever part of the handshake.
// A receiver that did not enable the fast path refuses frames with addresses (ProtocolError).

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "tdist/core/store.h"

namespace tdist::net {
class IssuedChallenges;  // core/net/handshake.h
}  // namespace tdist::net

namespace tdist::rpc::detail {

struct HandshakeResult {
  int peer_rank = -1;
  pid_t peer_pid = 0;
  bool send_remote_tensors = false;  // the peer reads our tensors from our memory
  bool read_remote_tensors = false;  // we read the peer's tensors from its memory
};

struct HandshakeOptions {
  std::string token;
  int my_rank = -1;
  int world_size = 0;
  bool fast_path = true;  // offer and accept the same-host fast path
  Millis timeout{10000};  // the whole handshake, from its first byte to its last
  // This worker's server challenges, which its client side refuses except on a connection to
  // itself (Note [Connection handshake]: reflection). The agent makes one; none: no check.
  std::shared_ptr<net::IssuedChallenges> issued;
};

// The accepting side. Throws (NetworkError / ProtocolError / TimeoutError) when the peer fails;
// the caller then closes the socket. `after_hello` (optional) runs once the HELLO verified; when
// it returns false (the connection was chosen to make room) the handshake stops with
// NetworkError and the caller sends send_busy().
HandshakeResult server_handshake(int fd, const HandshakeOptions& options,
                                 const std::function<bool()>& after_hello = {});
// Writes the busy marker (Note [RPC handshake]) if the socket takes it at once; never blocks.
void send_busy(int fd);
// The connecting side; `expected_peer` is the rank it meant to reach (for error messages).
HandshakeResult client_handshake(int fd, const HandshakeOptions& options, int expected_peer);

}  // namespace tdist::rpc::detail
