#pragma once
// Hostile clients of the connection handshake (Note [Connection handshake] in
// core/net/handshake.h), one set for every port that runs it (the store, the collective mesh,
// RPC): each connects to the port, plays its part and reports what the server did. A server
// "refuses" when it closes the connection without sending its acceptance.

#include <cstdint>
#include <string>

#include "tdist/core/net/handshake.h"

namespace tdist::test {

struct HandshakePort {
  std::string host;
  uint16_t port = 0;
  net::Service service = net::Service::kStore;
  size_t hello_fields = 0;  // the service's HELLO field bytes (sent as zeros)
};

// A connected socket to the port (read/write timeouts of 10 s, so a test never hangs).
int connect_to_port(const HandshakePort& p);
// True when the peer closes `fd` (EOF or reset) within `limit` (bytes before are skipped).
bool closed_within(int fd, Millis limit);

// A client that answers the challenge with a HELLO keyed with `token` (a wrong one, or "" for
// none): true when the server refused it.
bool refuses_token(const HandshakePort& p, const std::string& token);
// A HELLO keyed with the right `token` for one connection's challenge, recorded and sent on a
// second connection: true when the server refused it there.
bool refuses_replayed_hello(const HandshakePort& p, const std::string& token);
// A client that reads the challenge, sends half a HELLO keyed with `token` and stalls: the
// socket, for the caller to watch with closed_within().
int stalled_handshake(const HandshakePort& p, const std::string& token);

}  // namespace tdist::test
