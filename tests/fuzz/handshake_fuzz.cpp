// Fuzzes the connection handshake's checks (core/net/handshake.h) as both ends meet them: the
// input's first byte picks the role and the field sizes, the rest is what the peer sent —
// a CHALLENGE to a client, a HELLO and a CONFIRM to a server, an ACCEPT to a client. Any input
// must be refused with a ProtocolError (or pass, which only an input holding a valid MAC can:
// the fuzzer cannot forge one), never a crash, a sanitizer report or an allocation.
#include <cstdint>
#include <cstdlib>

#include "tdist/core/error.h"
#include "tdist/core/net/handshake.h"

namespace {

using tdist::Bytes;
using tdist::net::ClientHandshake;
using tdist::net::ServerHandshake;
using tdist::net::Service;

constexpr const char* kToken = "fuzz-token";

// Runs one check; a ProtocolError is the expected answer to bytes from a stranger.
template <class Fn>
void refused_or_passed(Fn fn) {
  try {
    fn();
  } catch (const tdist::ProtocolError&) {}
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  const size_t fields = (mode >> 2) % 16;
  const auto service = static_cast<Service>(1 + (mode >> 6) % 3);
  ++data;
  --size;
  switch (mode & 3) {
    case 0: {  // a client reads a challenge, then an acceptance
      ClientHandshake client(kToken, service);
      const size_t n = std::min(size, tdist::net::kChallengeBytes);
      bool answered = false;
      refused_or_passed([&] {
        client.hello(data, n, Bytes(fields, 1));
        answered = true;
      });
      if (answered) {
        refused_or_passed([&] { client.verify_accept(data + n, size - n, fields); });
      }
      break;
    }
    case 1: {  // a server reads a hello, then a confirmation
      ServerHandshake server(kToken, service);
      const size_t n = std::min(size, tdist::net::hello_bytes(fields));
      bool verified = false;
      refused_or_passed([&] {
        server.verify_hello(data, n, fields);
        verified = true;
      });
      if (verified) std::abort();  // a hello needs the MAC of this server's fresh nonce
      break;
    }
    default: {  // an honest exchange whose last message is replaced by the input
      ServerHandshake server(kToken, service);
      ClientHandshake client(kToken, service);
      const Bytes hello =
          client.hello(server.challenge().data(), server.challenge().size(), Bytes(fields, 2));
      server.verify_hello(hello.data(), hello.size(), fields);
      if ((mode & 3) == 2) {
        refused_or_passed([&] { client.verify_accept(data, size, fields); });
      } else {
        refused_or_passed([&] { server.verify_confirm(data, size, fields); });
      }
      break;
    }
  }
  return 0;
}
