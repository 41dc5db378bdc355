#include "tdist/rpc/auth.h"

#include <errno.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "tdist/core/error.h"

namespace tdist::rpc::detail {
namespace {

constexpr uint32_t kAuthMagic = 0x54554154;  // "TAUT"
constexpr uint16_t kAuthVersion = 1;

// The canary that peers read to test the same-host fast path (Note [RPC handshake]).
struct Canary {
  volatile uint64_t value = 0;
  Canary() {
    uint64_t v = 0;
    if (RAND_bytes(reinterpret_cast<unsigned char*>(&v), sizeof(v)) != 1) v = 0x5eed;
    value = v | 1;  // never zero
  }
};
Canary& canary() {
  static Canary c;
  return c;
}

void random_bytes(uint8_t* out, size_t n) {
  TDIST_CHECK(RAND_bytes(out, static_cast<int>(n)) == 1, "RAND_bytes failed");
}

class Buf {
 public:
  template <class T>
  void put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b_.insert(b_.end(), p, p + sizeof(T));
  }
  void put(const uint8_t* p, size_t n) { b_.insert(b_.end(), p, p + n); }
  std::vector<uint8_t>& bytes() { return b_; }

 private:
  std::vector<uint8_t> b_;
};

class Cursor {
 public:
  Cursor(const uint8_t* p, size_t n) : p_(p), end_(p + n) {}
  template <class T>
  T get() {
    TDIST_CHECK(p_ + sizeof(T) <= end_, "handshake message too short");
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  void get(uint8_t* out, size_t n) {
    TDIST_CHECK(p_ + n <= end_, "handshake message too short");
    std::memcpy(out, p_, n);
    p_ += n;
  }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

constexpr size_t kChallengeSize = 4 + 2 + 2 + 32 + 4 + 8 + 8;
constexpr size_t kResponseSize = 4 + 2 + 2 + 4 + 32 + 4 + 8 + 8 + 4 + 32;
constexpr size_t kAcceptSize = 4 + 4 + 32;

Digest mac_of(const std::string& token, const char* label, const std::vector<uint8_t>& fields,
              const uint8_t* n1, const uint8_t* n2) {
  std::vector<uint8_t> data(label, label + std::strlen(label));
  data.insert(data.end(), fields.begin(), fields.end());
  data.insert(data.end(), n1, n1 + 32);
  if (n2) data.insert(data.end(), n2, n2 + 32);
  return hmac_sha256(token, data.data(), data.size());
}

bool can_read_canary(bool fast_path, pid_t pid, uint64_t address, uint64_t value) {
  if (!fast_path || pid <= 0 || address == 0 || value == 0) return false;
  uint64_t seen = 0;
  try {
    read_process_memory(pid, address, &seen, sizeof(seen));
  } catch (const Error&) {
    return false;
  }
  return seen == value;
}

}  // namespace

Digest hmac_sha256(const std::string& key, const uint8_t* data, size_t size) {
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

void read_process_memory(pid_t pid, uint64_t address, void* out, size_t size) {
  auto* dst = static_cast<uint8_t*>(out);
  size_t done = 0;
  while (done < size) {
    struct iovec local = {dst + done, size - done};
    struct iovec remote = {reinterpret_cast<void*>(address + done), size - done};
    ssize_t n = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw NetworkError(str("cannot read ", size, " bytes of process ", pid,
                             " memory: ", n < 0 ? std::strerror(errno) : "nothing read"));
    }
    done += static_cast<size_t>(n);
  }
}

void read_exact(int fd, void* data, size_t size, const char* what) {
  auto* p = static_cast<uint8_t*>(data);
  while (size > 0) {
    ssize_t n = ::recv(fd, p, size, 0);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) throw NetworkError(str(what, ": connection closed by the peer"));
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) throw TimeoutError(str(what, ": timed out"));
    throw NetworkError(str(what, ": ", std::strerror(errno)));
  }
}

void write_all(int fd, const void* data, size_t size, const char* what) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      throw TimeoutError(str(what, ": timed out"));
    }
    throw NetworkError(str(what, ": ", std::strerror(errno)));
  }
}

void set_socket_timeouts(int fd, Millis timeout) {
  struct timeval tv {};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

HandshakeResult server_handshake(int fd, const HandshakeOptions& o) {
  set_socket_timeouts(fd, o.timeout);
  uint8_t nonce_s[32];
  random_bytes(nonce_s, sizeof(nonce_s));
  Buf ch;
  ch.put<uint32_t>(kAuthMagic);
  ch.put<uint16_t>(kAuthVersion);
  ch.put<uint16_t>(0);
  ch.put(nonce_s, 32);
  ch.put<uint32_t>(static_cast<uint32_t>(::getpid()));
  ch.put<uint64_t>(reinterpret_cast<uint64_t>(&canary().value));
  ch.put<uint64_t>(canary().value);
  write_all(fd, ch.bytes().data(), ch.bytes().size(), "handshake: sending the challenge");

  uint8_t resp[kResponseSize];
  read_exact(fd, resp, sizeof(resp), "handshake: reading the response");
  Cursor c(resp, sizeof(resp));
  if (c.get<uint32_t>() != kAuthMagic) throw ProtocolError("handshake: bad magic");
  if (c.get<uint16_t>() != kAuthVersion) throw ProtocolError("handshake: unsupported version");
  c.get<uint16_t>();
  HandshakeResult r;
  r.peer_rank = c.get<int32_t>();
  uint8_t nonce_c[32];
  c.get(nonce_c, 32);
  r.peer_pid = static_cast<pid_t>(c.get<uint32_t>());
  uint64_t peer_canary_addr = c.get<uint64_t>();
  uint64_t peer_canary = c.get<uint64_t>();
  uint32_t client_reads_us = c.get<uint32_t>();
  Digest mac_c;
  c.get(mac_c.data(), mac_c.size());
  std::vector<uint8_t> fields(resp, resp + kResponseSize - 32);
  Digest expect = mac_of(o.token, "tdist-rpc-client", fields, nonce_s, nullptr);
  if (CRYPTO_memcmp(expect.data(), mac_c.data(), expect.size()) != 0) {
    throw ProtocolError("handshake: authentication failed (wrong or missing token)");
  }
  if (r.peer_rank < 0 || r.peer_rank >= o.world_size) {
    throw ProtocolError(str("handshake: rank ", r.peer_rank, " is not in [0, ", o.world_size, ")"));
  }
  r.read_remote_tensors = can_read_canary(o.fast_path, r.peer_pid, peer_canary_addr, peer_canary);
  r.send_remote_tensors = o.fast_path && client_reads_us == 1;

  Buf acc;
  acc.put<uint32_t>(kAuthMagic);
  acc.put<uint32_t>(r.read_remote_tensors ? 1 : 0);
  Digest mac_s = mac_of(o.token, "tdist-rpc-server", acc.bytes(), nonce_c, nonce_s);
  acc.put(mac_s.data(), mac_s.size());
  write_all(fd, acc.bytes().data(), acc.bytes().size(), "handshake: sending the acceptance");
  set_socket_timeouts(fd, Millis(0));
  return r;
}

HandshakeResult client_handshake(int fd, const HandshakeOptions& o, int expected_peer) {
  set_socket_timeouts(fd, o.timeout);
  auto where = str("handshake with worker rank ", expected_peer);
  uint8_t ch[kChallengeSize];
  read_exact(fd, ch, sizeof(ch), where.c_str());
  Cursor c(ch, sizeof(ch));
  if (c.get<uint32_t>() != kAuthMagic) throw ProtocolError(where + ": bad magic");
  if (c.get<uint16_t>() != kAuthVersion) throw ProtocolError(where + ": unsupported version");
  c.get<uint16_t>();
  uint8_t nonce_s[32];
  c.get(nonce_s, 32);
  HandshakeResult r;
  r.peer_rank = expected_peer;
  r.peer_pid = static_cast<pid_t>(c.get<uint32_t>());
  uint64_t peer_canary_addr = c.get<uint64_t>();
  uint64_t peer_canary = c.get<uint64_t>();
  r.read_remote_tensors = can_read_canary(o.fast_path, r.peer_pid, peer_canary_addr, peer_canary);

  uint8_t nonce_c[32];
  random_bytes(nonce_c, sizeof(nonce_c));
  Buf resp;
  resp.put<uint32_t>(kAuthMagic);
  resp.put<uint16_t>(kAuthVersion);
  resp.put<uint16_t>(0);
  resp.put<int32_t>(o.my_rank);
  resp.put(nonce_c, 32);
  resp.put<uint32_t>(static_cast<uint32_t>(::getpid()));
  resp.put<uint64_t>(reinterpret_cast<uint64_t>(&canary().value));
  resp.put<uint64_t>(canary().value);
  resp.put<uint32_t>(r.read_remote_tensors ? 1 : 0);
  Digest mac_c = mac_of(o.token, "tdist-rpc-client", resp.bytes(), nonce_s, nullptr);
  resp.put(mac_c.data(), mac_c.size());
  write_all(fd, resp.bytes().data(), resp.bytes().size(), where.c_str());

  uint8_t acc[kAcceptSize];
  try {
    read_exact(fd, acc, sizeof(acc), where.c_str());
  } catch (const NetworkError& e) {
    // The worker closed after reading our answer: it refused it. A ProtocolError, so that the
    // agent does not retry the connect (RpcAgent::Peer).
    throw ProtocolError(str(e.what(), " (the worker rejected this connection: is the token "
                                      "the same on every worker?)"));
  }
  Cursor a(acc, sizeof(acc));
  if (a.get<uint32_t>() != kAuthMagic) throw ProtocolError(where + ": bad magic");
  uint32_t server_reads_us = a.get<uint32_t>();
  Digest mac_s;
  a.get(mac_s.data(), mac_s.size());
  std::vector<uint8_t> fields(acc, acc + 8);
  Digest expect = mac_of(o.token, "tdist-rpc-server", fields, nonce_c, nonce_s);
  if (CRYPTO_memcmp(expect.data(), mac_s.data(), expect.size()) != 0) {
    throw ProtocolError(where + ": the worker failed authentication (wrong or missing token)");
  }
  r.send_remote_tensors = o.fast_path && server_reads_us == 1;
  set_socket_timeouts(fd, Millis(0));
  return r;
}

}  // namespace tdist::rpc::detail
