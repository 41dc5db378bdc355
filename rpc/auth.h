#pragma once
// The connection handshake: authentication with a shared token, the connecting worker's rank,
// and whether the same-host fast path works between the two processes.
//
// Note [RPC handshake]
// ~~~~~~~~~~~~~~~~~~~~
// Runs on every new connection before any frame is read. Sizes are fixed; nothing is allocated
// from what the peer sends; each read and write has a timeout.
//
//   server -> client  CHALLENGE  magic "TAUT", version, nonce_s (32 random bytes), pid_s,
//                                address and value of the server's canary (see below)
//   client -> server  RESPONSE   magic, version, client rank, nonce_c, pid_c, client canary,
//                                whether the client could read the server's canary,
//                                mac_c = HMAC-SHA256(token, "tdist-rpc-client" | RESPONSE
//                                        fields before mac_c | nonce_s)
//   server -> client  ACCEPT     magic, whether the server could read the client's canary,
//                                mac_s = HMAC-SHA256(token, "tdist-rpc-server" | ACCEPT fields
//                                        before mac_s | nonce_c | nonce_s)
//
// The server closes the connection, without a word, when the magic, version or rank is wrong or
// mac_c does not verify (constant-time compare); the client closes it when mac_s does not verify.
// Both nonces are fresh per connection, so a recorded handshake cannot be replayed. Without a
// token both sides key HMAC with the empty string: a worker that has a token rejects one that
// has none. The token never travels. (Authentication only: frames are not encrypted.)
//
// Same-host fast path: each process holds a random 64-bit canary. A side that can read the
// peer's canary with process_vm_readv(pid, address) and finds the announced value may read that
// peer's tensors straight from its memory; it says so in its message, and the peer then sends it
// tensor addresses instead of bytes (kFlagRemoteTensors). A different host, a different PID
// namespace or a kernel that forbids it all make the check fail, and bytes go through the socket.

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
  Millis timeout{10000};
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
void write_all(int fd, const void* data, size_t size, const char* what);
void set_socket_timeouts(int fd, Millis timeout);  // 0: none

}  // namespace tdist::rpc::detail
