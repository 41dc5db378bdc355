#pragma once
// The connection handshake: authentication with a shared token, the connecting worker's rank,
// and whether the same-host fast path works between the two processes.
//
// Note [RPC handshake]
// ~~~~~~~~~~~~~~~~~~~~
// Runs on every new connection before any frame is read. Sizes are fixed; nothing is allocated
// from what the peer sends; the whole handshake has one deadline (HandshakeOptions::timeout),
// not one per read, so a peer that trickles bytes is dropped when it passes.
//
//   server -> client  CHALLENGE  magic "TAUT", version, nonce_s (32 random bytes)
//   client -> server  RESPONSE   magic, version, client rank, nonce_c, pid_c, fast-path wish,
//                                mac_c = HMAC-SHA256(token, "tdist-rpc-client" | RESPONSE
//                                        fields before mac_c | nonce_s)
//   server -> client  ACCEPT     magic, pid_s, whether the server reads the client's tensors,
//                                mac_s = HMAC-SHA256(token, "tdist-rpc-server" | ACCEPT fields
//                                        before mac_s | nonce_c | nonce_s)
//   client -> server  CONFIRM    magic, whether the client reads the server's tensors,
//                                mac_k = HMAC-SHA256(token, "tdist-rpc-confirm" | CONFIRM fields
//                                        before mac_k | nonce_s | nonce_c)
//
// The server closes the connection, without a word, when the magic, version or rank is wrong or
// mac_c does not verify (constant-time compare); the client closes it when mac_s does not verify
// and looks at nothing else in ACCEPT before it did; the server uses CONFIRM only once mac_k
// verifies. Both nonces are fresh per connection, so a recorded handshake cannot be replayed.
// Without a token both sides key HMAC with the empty string: a worker that has a token rejects
// one that has none. The token never travels. (Authentication only: frames are not encrypted.)
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

#include <array>
#include <chrono>
#include <cstdint>
#include <string>

#include "tdist/core/store.h"

namespace tdist::rpc::detail {

using Digest = std::array<uint8_t, 32>;

Digest hmac_sha256(const std::string& key, const uint8_t* data, size_t size);

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
};

// The accepting side. Throws (NetworkError / ProtocolError / TimeoutError) when the peer fails;
// the caller then closes the socket.
HandshakeResult server_handshake(int fd, const HandshakeOptions& options);
// The connecting side; `expected_peer` is the rank it meant to reach (for error messages).
HandshakeResult client_handshake(int fd, const HandshakeOptions& options, int expected_peer);

// Reads `size` bytes of process `pid` at `address` into `out` (process_vm_readv). Throws
// NetworkError when the kernel refuses or the range is not mapped.
void read_process_memory(pid_t pid, uint64_t address, void* out, size_t size);

// Blocking socket helpers shared with the connection code. Both honour SO_RCVTIMEO/SO_SNDTIMEO
// (TimeoutError) and report EOF and errors as NetworkError naming `what`.
void read_exact(int fd, void* data, size_t size, const char* what);
// The same, but all of it by `deadline` (TimeoutError naming `what` otherwise), however the
// bytes trickle in.
void read_exact_until(int fd, void* data, size_t size,
                      std::chrono::steady_clock::time_point deadline, const char* what);
void write_all(int fd, const void* data, size_t size, const char* what);
void set_socket_timeouts(int fd, Millis timeout);  // 0: none

}  // namespace tdist::rpc::detail
