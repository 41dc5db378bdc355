#pragma once
// The connection handshake: one HMAC-SHA256 challenge-response that every tdist connection
// passes before any other byte is read or any state changes — store clients, the collective
// mesh and RPC alike. It authenticates both ends with the job's shared token (core/token.h) and
// carries a few fixed-size fields of the protocol that runs on the connection afterwards.
//
// Note [Connection handshake]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
//   server -> client  CHALLENGE  magic "TDHS", version, service, nonce_s (32 random bytes)
//   client -> server  HELLO      magic, version, service, nonce_c (32 random bytes), the
//                                client's fields, mac_c
//   server -> client  ACCEPT     magic, the server's fields, mac_s
//   client -> server  CONFIRM    magic, the client's second fields, mac_k   (RPC only)
//
// with mac_x = HMAC-SHA256(token, label_x | service | the message's bytes before its MAC |
// nonces), the labels "tdist-hello", "tdist-accept", "tdist-confirm" and the nonces nonce_s for
// HELLO, nonce_c | nonce_s for ACCEPT, nonce_s | nonce_c for CONFIRM. Every size is fixed by the
// service (the store sends no fields, the mesh its rank and channel, RPC its rank, pid and
// fast-path wish), so nothing is allocated from what a peer sends.
//
// The server sends only the challenge (which reveals nothing) before mac_c verified; it closes
// the connection, without a word, when the magic, version or service is wrong or mac_c does not
// verify (constant-time compare). The client looks at nothing in ACCEPT before mac_s verified,
// so a server without the token learns nothing and cannot make the client act. Both nonces are
// fresh per connection: a recorded handshake cannot be replayed, and a server's answer cannot be
// used on another connection. The service is part of every MAC, so a HELLO meant for one port
// is worthless on another. Without a token both sides key HMAC with the empty string, which
// only keeps honest peers of different jobs apart: a side that has a token rejects one that has
// none. The token itself never travels. (Authentication only: what follows is not encrypted.)
//
// Reflection: whoever answers at a peer's address could hand a client the challenge of the
// client's own endpoint's server (got on a second connection to it), and relay the HELLO the
// client then signs back to that server, which would accept it. An endpoint that both accepts
// and connects at once (the RPC agent) therefore gives its server handshakes an
// IssuedChallenges and its client handshakes the same one to refuse, except on a connection it
// makes to itself (an RPC to this worker). The mesh needs none: a rank makes its connections
// before its server sends any challenge, and refuses a hello from its own rank. The store has
// no identities to bind: rank 0's client reaches the server in its own process.
//
// The classes are the protocol without the I/O (they build and check messages), so the store's
// Boost.Asio server, the mesh's poll loop and RPC's threads drive the same code; the blocking
// client_handshake() below serves the connecting side of the store and the mesh.
// Thread safety: one object per connection side, used by one thread at a time.

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "tdist/core/net/frame.h"
#include "tdist/core/net/socket_io.h"
#include "tdist/core/store.h"

namespace tdist::net {

// The challenges one endpoint's live server handshakes issued (Note [Connection handshake]:
// reflection). Thread-safe.
class IssuedChallenges {
 public:
  // Whether the CHALLENGE message `challenge` (kChallengeBytes) is one of them.
  bool issued(const uint8_t* challenge, size_t size) const;

 private:
  friend class ServerHandshake;
  struct Registration;  // a nonce, issued while its handshake (or a copy) lives
  mutable std::mutex mu_;
  std::set<std::array<uint8_t, 32>> live_;  // guarded by mu_
};

enum class Service : uint16_t { kStore = 1, kMesh = 2, kRpc = 3 };
const char* service_name(Service service);

using Digest = std::array<uint8_t, 32>;
Digest hmac_sha256(const std::string& key, const uint8_t* data, size_t size);

constexpr size_t kChallengeBytes = kFramePrefixBytes + 32;
constexpr size_t kMacBytes = 32;
// Sizes of the other messages for `fields` bytes of fields.
constexpr size_t hello_bytes(size_t fields) { return kFramePrefixBytes + 32 + fields + kMacBytes; }
constexpr size_t accept_bytes(size_t fields) { return 4 + fields + kMacBytes; }
constexpr size_t confirm_bytes(size_t fields) { return 4 + fields + kMacBytes; }

// The accepting side. Every verify_* throws ProtocolError saying what was wrong ("another
// service", "authentication failed: wrong or missing token", ...); the caller then closes the
// connection without answering.
class ServerHandshake {
 public:
  // `issued`: the endpoint's challenges, this one among them while the object (or a copy) lives.
  ServerHandshake(std::string token, Service service,
                  std::shared_ptr<IssuedChallenges> issued = nullptr);
  // The first message, sent as soon as the connection is accepted.
  const Bytes& challenge() const { return challenge_; }
  // Checks a HELLO of hello_bytes(fields) bytes; returns the client's fields.
  Bytes verify_hello(const uint8_t* msg, size_t size, size_t fields);
  // The ACCEPT message carrying `fields` (only after verify_hello succeeded).
  Bytes accept(const Bytes& fields) const;
  // Checks a CONFIRM of confirm_bytes(fields) bytes; returns its fields.
  Bytes verify_confirm(const uint8_t* msg, size_t size, size_t fields) const;

 private:
  std::string token_;
  Service service_;
  std::array<uint8_t, 32> nonce_s_{};
  std::array<uint8_t, 32> nonce_c_{};
  bool hello_verified_ = false;
  Bytes challenge_;
  std::shared_ptr<const void> registration_;  // in `issued`, if given
};

// The connecting side. Throws ProtocolError when the server's messages are not what the
// protocol says (another service, a failed MAC: the server has another token).
class ClientHandshake {
 public:
  // `refuse`: the endpoint's own challenges, which hello() refuses (a reflected handshake).
  ClientHandshake(std::string token, Service service,
                  std::shared_ptr<const IssuedChallenges> refuse = nullptr);
  // Checks the CHALLENGE (kChallengeBytes) and returns the HELLO carrying `fields`.
  Bytes hello(const uint8_t* challenge, size_t size, const Bytes& fields);
  // Checks an ACCEPT of accept_bytes(fields) bytes; returns the server's fields.
  Bytes verify_accept(const uint8_t* msg, size_t size, size_t fields) const;
  // The CONFIRM message carrying `fields` (only after verify_accept succeeded).
  Bytes confirm(const Bytes& fields) const;

 private:
  std::string token_;
  Service service_;
  std::array<uint8_t, 32> nonce_s_{};
  std::array<uint8_t, 32> nonce_c_{};
  bool challenge_seen_ = false;
  std::shared_ptr<const IssuedChallenges> refuse_;
};

// The connecting side on a connected socket, all of it by `deadline`: reads the CHALLENGE,
// sends HELLO with `fields`, reads and verifies an ACCEPT of `accept_fields` bytes and returns
// its fields. `who` names the server in errors. A server that closes the connection after our
// HELLO refused it: that is a ProtocolError ("... refused this connection: is the token the
// same on every process?"), which callers do not retry; timeouts and other socket failures
// keep their own types (TimeoutError, NetworkError).
Bytes client_handshake(int fd, ClientHandshake& handshake, const Bytes& fields,
                       size_t accept_fields, Clock::time_point deadline, const std::string& who);

}  // namespace tdist::net
