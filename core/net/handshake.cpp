#include "tdist/core/net/handshake.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstring>

#include "tdist/core/error.h"
#include "tdist/core/net/frame.h"
#include "tdist/core/wire.h"

namespace tdist::net {
namespace {

constexpr uint32_t kMagic = 0x53484454;  // "TDHS"
constexpr uint16_t kVersion = 1;
// CHALLENGE and HELLO start with the frame prefix (Note [Frame prefix]); its code is the service.
constexpr FrameProtocol kProtocol{kMagic, kVersion, "tdist's handshake"};
using Nonce = std::array<uint8_t, 32>;

// OpenSSL frees its state in an atexit handler registered at its first use, so a handshake made
// from an exit handler or static destructor registered before that (a store closed at exit)
// would use freed state. tdist initialises it first, without that handler: the process's exit
// frees the memory anyway.
void init_crypto() {
  static const bool ok = OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, nullptr) == 1;
  TDIST_CHECK(ok, "OpenSSL could not be initialised");
}

Nonce random_nonce() {
  init_crypto();
  Nonce n{};
  TDIST_CHECK(RAND_bytes(n.data(), static_cast<int>(n.size())) == 1, "RAND_bytes failed");
  return n;
}

// HMAC(token, label | service | msg | n1 | n2) (Note [Connection handshake]).
Digest mac_of(const std::string& token, const char* label, Service service, const uint8_t* msg,
              size_t size, const Nonce& n1, const Nonce* n2) {
  Bytes data(label, label + std::strlen(label));
  wire::Writer w(data);
  w.u16(static_cast<uint16_t>(service));
  w.raw(msg, size);
  w.raw(n1.data(), n1.size());
  if (n2) w.raw(n2->data(), n2->size());
  return hmac_sha256(token, data.data(), data.size());
}

void seal(Bytes& msg, const std::string& token, const char* label, Service service, const Nonce& n1,
          const Nonce* n2) {
  const Digest mac = mac_of(token, label, service, msg.data(), msg.size(), n1, n2);
  msg.insert(msg.end(), mac.begin(), mac.end());
}

// The magic, the fields and the MAC: the server's accept and the client's confirm.
Bytes sealed_fields(const Bytes& fields, const std::string& token, const char* label,
                    Service service, const Nonce& n1, const Nonce& n2) {
  Bytes msg;
  wire::Writer w(msg);
  w.u32(kMagic);
  w.raw(fields.data(), fields.size());
  seal(msg, token, label, service, n1, &n2);
  return msg;
}

bool sealed(const uint8_t* msg, size_t size, const std::string& token, const char* label,
            Service service, const Nonce& n1, const Nonce* n2) {
  const Digest expect = mac_of(token, label, service, msg, size - kMacBytes, n1, n2);
  return CRYPTO_memcmp(expect.data(), msg + size - kMacBytes, kMacBytes) == 0;
}

void check_size(size_t size, size_t expected, const char* message) {
  if (size != expected) {
    TDIST_THROW(ProtocolError, "handshake: the ", message, " has ", size, " bytes, not ", expected);
  }
}

void write_preamble(wire::Writer& w, Service service) {
  uint8_t prefix[kFramePrefixBytes];
  encode_frame_prefix(kProtocol, static_cast<uint16_t>(service), prefix);
  w.raw(prefix, sizeof(prefix));
}

// Magic, version and service of a CHALLENGE or HELLO; ProtocolError naming what differs.
void check_preamble(wire::Reader& r, Service service, const char* message) {
  const FramePrefix prefix = decode_frame_prefix(r.raw(kFramePrefixBytes, "frame prefix"));
  if (std::string problem = frame_problem(prefix, kProtocol); !problem.empty()) {
    TDIST_THROW(ProtocolError, "handshake: the ", message, ": ", problem);
  }
  if (prefix.code != static_cast<uint16_t>(service)) {
    TDIST_THROW(ProtocolError, "handshake: the peer speaks to a ",
                service_name(static_cast<Service>(prefix.code)), " port, this is a ",
                service_name(service), " port");
  }
}

Bytes fields_of(const uint8_t* msg, size_t size, size_t offset) {
  return Bytes(msg + offset, msg + size - kMacBytes);
}

}  // namespace

const char* service_name(Service service) {
  switch (service) {
    case Service::kStore:
      return "store";
    case Service::kMesh:
      return "collective mesh";
    case Service::kRpc:
      return "RPC";
  }
  return "unknown";
}

Digest hmac_sha256(const std::string& key, const uint8_t* data, size_t size) {
  init_crypto();
  Digest out{};
  unsigned int len = 0;
  static const unsigned char kEmpty = 0;
  const void* k = key.empty() ? static_cast<const void*>(&kEmpty) : key.data();
  TDIST_CHECK(HMAC(EVP_sha256(), k, static_cast<int>(key.size()), data, size, out.data(), &len) !=
                      nullptr &&
                  len == out.size(),
              "HMAC-SHA256 failed");
  return out;
}

// ---- IssuedChallenges ---------------------------------------------------------------------------

struct IssuedChallenges::Registration {
  Registration(std::shared_ptr<IssuedChallenges> in, const Nonce& n)
      : set(std::move(in)), nonce(n) {
    std::lock_guard<std::mutex> lock(set->mu_);
    set->live_.insert(nonce);
  }
  ~Registration() {
    std::lock_guard<std::mutex> lock(set->mu_);
    set->live_.erase(nonce);
  }
  const std::shared_ptr<IssuedChallenges> set;
  const Nonce nonce;
};

bool IssuedChallenges::issued(const uint8_t* challenge, size_t size) const {
  if (size != kChallengeBytes) return false;
  Nonce n{};
  std::memcpy(n.data(), challenge + size - n.size(), n.size());
  std::lock_guard<std::mutex> lock(mu_);
  return live_.count(n) > 0;
}

// ---- ServerHandshake ----------------------------------------------------------------------------

ServerHandshake::ServerHandshake(std::string token, Service service,
                                 std::shared_ptr<IssuedChallenges> issued)
    : token_(std::move(token)), service_(service), nonce_s_(random_nonce()) {
  wire::Writer w(challenge_);
  write_preamble(w, service_);
  w.raw(nonce_s_.data(), nonce_s_.size());
  if (issued) {
    registration_ =
        std::make_shared<const IssuedChallenges::Registration>(std::move(issued), nonce_s_);
  }
}

Bytes ServerHandshake::verify_hello(const uint8_t* msg, size_t size, size_t fields) {
  check_size(size, hello_bytes(fields), "hello");
  wire::Reader r(msg, size);
  check_preamble(r, service_, "hello");
  std::memcpy(nonce_c_.data(), r.raw(nonce_c_.size()), nonce_c_.size());
  if (!sealed(msg, size, token_, "tdist-hello", service_, nonce_s_, nullptr)) {
    throw ProtocolError("handshake: authentication failed (wrong or missing token)");
  }
  hello_verified_ = true;
  return fields_of(msg, size, r.position());
}

Bytes ServerHandshake::accept(const Bytes& fields) const {
  TDIST_CHECK(hello_verified_, "handshake: accept() before the hello verified");
  return sealed_fields(fields, token_, "tdist-accept", service_, nonce_c_, nonce_s_);
}

Bytes ServerHandshake::verify_confirm(const uint8_t* msg, size_t size, size_t fields) const {
  TDIST_CHECK(hello_verified_, "handshake: verify_confirm() before the hello verified");
  check_size(size, confirm_bytes(fields), "confirmation");
  wire::Reader r(msg, size);
  if (r.u32() != kMagic) throw ProtocolError("handshake: the confirmation has a bad magic");
  if (!sealed(msg, size, token_, "tdist-confirm", service_, nonce_s_, &nonce_c_)) {
    throw ProtocolError("handshake: the confirmation failed authentication");
  }
  return fields_of(msg, size, r.position());
}

// ---- ClientHandshake ----------------------------------------------------------------------------

ClientHandshake::ClientHandshake(std::string token, Service service,
                                 std::shared_ptr<const IssuedChallenges> refuse)
    : token_(std::move(token)),
      service_(service),
      nonce_c_(random_nonce()),
      refuse_(std::move(refuse)) {}

Bytes ClientHandshake::hello(const uint8_t* challenge, size_t size, const Bytes& fields) {
  check_size(size, kChallengeBytes, "challenge");
  wire::Reader r(challenge, size);
  check_preamble(r, service_, "challenge");
  if (refuse_ && refuse_->issued(challenge, size)) {
    throw ProtocolError(str("handshake: the ", service_name(service_),
                            " challenge came from this endpoint's own server: whoever answered "
                            "here reflected it (Note [Connection handshake])"));
  }
  std::memcpy(nonce_s_.data(), r.raw(nonce_s_.size()), nonce_s_.size());
  challenge_seen_ = true;
  Bytes msg;
  wire::Writer w(msg);
  write_preamble(w, service_);
  w.raw(nonce_c_.data(), nonce_c_.size());
  w.raw(fields.data(), fields.size());
  seal(msg, token_, "tdist-hello", service_, nonce_s_, nullptr);
  return msg;
}

Bytes ClientHandshake::verify_accept(const uint8_t* msg, size_t size, size_t fields) const {
  TDIST_CHECK(challenge_seen_, "handshake: verify_accept() before the challenge");
  check_size(size, accept_bytes(fields), "acceptance");
  // Nothing in ACCEPT counts before its MAC verified (Note [Connection handshake]).
  if (!sealed(msg, size, token_, "tdist-accept", service_, nonce_c_, &nonce_s_)) {
    throw ProtocolError("handshake: the server failed authentication (wrong or missing token)");
  }
  wire::Reader r(msg, size);
  if (r.u32() != kMagic) throw ProtocolError("handshake: the acceptance has a bad magic");
  return fields_of(msg, size, r.position());
}

Bytes ClientHandshake::confirm(const Bytes& fields) const {
  TDIST_CHECK(challenge_seen_, "handshake: confirm() before the challenge");
  return sealed_fields(fields, token_, "tdist-confirm", service_, nonce_s_, nonce_c_);
}

Bytes client_handshake(int fd, ClientHandshake& handshake, const Bytes& fields,
                       size_t accept_fields, Clock::time_point deadline, const std::string& who) {
  const std::string where = str("handshake with ", who);
  uint8_t challenge[kChallengeBytes];
  read_exact(fd, challenge, sizeof(challenge), deadline, where);
  Bytes hello;
  try {
    hello = handshake.hello(challenge, sizeof(challenge), fields);
  } catch (const ProtocolError& e) {
    throw ProtocolError(str(where, ": ", e.what()));
  }
  write_all(fd, hello.data(), hello.size(), deadline, where);
  Bytes accept(accept_bytes(accept_fields));
  try {
    read_exact(fd, accept.data(), accept.size(), deadline, where);
  } catch (const NetworkError& e) {
    // The server closed after reading our hello: it refused it. A ProtocolError, so that
    // callers do not retry the connect.
    throw ProtocolError(str(e.what(), " (", who,
                            " refused this connection: is the token the "
                            "same on every process?)"));
  }
  try {
    return handshake.verify_accept(accept.data(), accept.size(), accept_fields);
  } catch (const ProtocolError& e) {
    throw ProtocolError(str(where, ": ", e.what()));
  }
}

}  // namespace tdist::net
