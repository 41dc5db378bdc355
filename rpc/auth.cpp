#include "tdist/rpc/auth.h"

#include <errno.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/rpc/detail/same_host.h"
#include "tdist/rpc/types.h"

namespace tdist::rpc::detail {
namespace {

constexpr uint32_t kAuthMagic = 0x54554154;  // "TAUT"
constexpr uint16_t kAuthVersion = 2;

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

constexpr size_t kChallengeSize = 4 + 2 + 2 + 32;
constexpr size_t kResponseSize = 4 + 2 + 2 + 4 + 32 + 4 + 4 + 32;
constexpr size_t kAcceptSize = 4 + 4 + 4 + 4 + 32;
constexpr size_t kConfirmSize = 4 + 4 + 32;

Digest mac_of(const std::string& token, const char* label, const uint8_t* fields, size_t size,
              const uint8_t* n1, const uint8_t* n2) {
  std::vector<uint8_t> data(label, label + std::strlen(label));
  data.insert(data.end(), fields, fields + size);
  data.insert(data.end(), n1, n1 + 32);
  if (n2) data.insert(data.end(), n2, n2 + 32);
  return hmac_sha256(token, data.data(), data.size());
}

// Appends the MAC of everything in `b` so far.
void seal(Buf& b, const std::string& token, const char* label, const uint8_t* n1,
          const uint8_t* n2) {
  Digest mac = mac_of(token, label, b.bytes().data(), b.bytes().size(), n1, n2);
  b.put(mac.data(), mac.size());
}

// Whether the last 32 bytes of msg are the MAC of the bytes before them.
bool sealed(const uint8_t* msg, size_t size, const std::string& token, const char* label,
            const uint8_t* n1, const uint8_t* n2) {
  Digest expect = mac_of(token, label, msg, size - 32, n1, n2);
  return CRYPTO_memcmp(expect.data(), msg + size - 32, expect.size()) == 0;
}

// The reading side's fast-path decision (Note [RPC handshake]): from its own checks only.
bool may_read_peer(bool fast_path, bool peer_wants, int fd, pid_t pid, const std::string& who) {
  if (!fast_path || !peer_wants) return false;
  std::string why;
  if (peer_is_local_process(fd, pid, &why)) return true;
  TDIST_LOG_DEBUG("rpc: no same-host fast path with ", who, ": ", why);
  return false;
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

void read_exact_until(int fd, void* data, size_t size, Clock::time_point deadline,
                      const char* what) {
  auto* p = static_cast<uint8_t*>(data);
  while (size > 0) {
    const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
    if (left <= 0) throw TimeoutError(str(what, ": timed out"));
    pollfd pfd{fd, POLLIN, 0};
    int rc = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left, INT32_MAX)));
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) throw NetworkError(str(what, ": ", std::strerror(errno)));
    if (rc == 0) continue;  // the loop's deadline check throws
    ssize_t n = ::recv(fd, p, size, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) throw NetworkError(str(what, ": connection closed by the peer"));
    if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
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
  const auto deadline = Clock::now() + o.timeout;
  set_socket_timeouts(fd, o.timeout);  // bounds the writes
  uint8_t nonce_s[32];
  random_bytes(nonce_s, sizeof(nonce_s));
  Buf ch;
  ch.put<uint32_t>(kAuthMagic);
  ch.put<uint16_t>(kAuthVersion);
  ch.put<uint16_t>(0);
  ch.put(nonce_s, 32);
  write_all(fd, ch.bytes().data(), ch.bytes().size(), "handshake: sending the challenge");

  uint8_t resp[kResponseSize];
  read_exact_until(fd, resp, sizeof(resp), deadline, "handshake: reading the response");
  Cursor c(resp, sizeof(resp));
  if (c.get<uint32_t>() != kAuthMagic) throw ProtocolError("handshake: bad magic");
  if (c.get<uint16_t>() != kAuthVersion) throw ProtocolError("handshake: unsupported version");
  c.get<uint16_t>();
  HandshakeResult r;
  r.peer_rank = c.get<int32_t>();
  uint8_t nonce_c[32];
  c.get(nonce_c, 32);
  const auto claimed_pid = static_cast<pid_t>(c.get<uint32_t>());
  const bool client_wants = c.get<uint32_t>() == 1;
  if (!sealed(resp, sizeof(resp), o.token, "tdist-rpc-client", nonce_s, nullptr)) {
    throw ProtocolError("handshake: authentication failed (wrong or missing token)");
  }
  if (r.peer_rank < 0 || r.peer_rank >= o.world_size) {
    throw ProtocolError(str("handshake: rank ", r.peer_rank, " is not in [0, ", o.world_size, ")"));
  }
  // Authenticated: from here on the peer may learn our pid, and we check its claim.
  r.read_remote_tensors = may_read_peer(o.fast_path, client_wants, fd, claimed_pid,
                                        str("worker rank ", r.peer_rank));
  if (r.read_remote_tensors) r.peer_pid = claimed_pid;

  Buf acc;
  acc.put<uint32_t>(kAuthMagic);
  acc.put<uint32_t>(static_cast<uint32_t>(::getpid()));
  acc.put<uint32_t>(r.read_remote_tensors ? 1 : 0);
  acc.put<uint32_t>(o.fast_path ? 1 : 0);
  seal(acc, o.token, "tdist-rpc-server", nonce_c, nonce_s);
  write_all(fd, acc.bytes().data(), acc.bytes().size(), "handshake: sending the acceptance");

  uint8_t confirm[kConfirmSize];
  read_exact_until(fd, confirm, sizeof(confirm), deadline, "handshake: reading the confirmation");
  Cursor k(confirm, sizeof(confirm));
  if (k.get<uint32_t>() != kAuthMagic) throw ProtocolError("handshake: bad magic");
  const bool client_reads_us = k.get<uint32_t>() == 1;
  if (!sealed(confirm, sizeof(confirm), o.token, "tdist-rpc-confirm", nonce_s, nonce_c)) {
    throw ProtocolError("handshake: the confirmation failed authentication");
  }
  r.send_remote_tensors = o.fast_path && client_reads_us;
  set_socket_timeouts(fd, Millis(0));
  return r;
}

HandshakeResult client_handshake(int fd, const HandshakeOptions& o, int expected_peer) {
  const auto deadline = Clock::now() + o.timeout;
  set_socket_timeouts(fd, o.timeout);  // bounds the writes
  auto where = str("handshake with worker rank ", expected_peer);
  uint8_t ch[kChallengeSize];
  read_exact_until(fd, ch, sizeof(ch), deadline, where.c_str());
  Cursor c(ch, sizeof(ch));
  if (c.get<uint32_t>() != kAuthMagic) throw ProtocolError(where + ": bad magic");
  if (c.get<uint16_t>() != kAuthVersion) throw ProtocolError(where + ": unsupported version");
  c.get<uint16_t>();
  uint8_t nonce_s[32];
  c.get(nonce_s, 32);
  HandshakeResult r;
  r.peer_rank = expected_peer;

  uint8_t nonce_c[32];
  random_bytes(nonce_c, sizeof(nonce_c));
  Buf resp;
  resp.put<uint32_t>(kAuthMagic);
  resp.put<uint16_t>(kAuthVersion);
  resp.put<uint16_t>(0);
  resp.put<int32_t>(o.my_rank);
  resp.put(nonce_c, 32);
  resp.put<uint32_t>(static_cast<uint32_t>(::getpid()));
  resp.put<uint32_t>(o.fast_path ? 1 : 0);
  seal(resp, o.token, "tdist-rpc-client", nonce_s, nullptr);
  write_all(fd, resp.bytes().data(), resp.bytes().size(), where.c_str());

  uint8_t acc[kAcceptSize];
  try {
    read_exact_until(fd, acc, sizeof(acc), deadline, where.c_str());
  } catch (const NetworkError& e) {
    // The worker closed after reading our answer: it refused it. A ProtocolError, so that the
    // agent does not retry the connect (RpcAgent::Peer).
    throw ProtocolError(str(e.what(), " (the worker rejected this connection: is the token "
                                      "the same on every worker?)"));
  }
  // Nothing in ACCEPT counts before its MAC verified (Note [RPC handshake]).
  if (!sealed(acc, sizeof(acc), o.token, "tdist-rpc-server", nonce_c, nonce_s)) {
    throw ProtocolError(where + ": the worker failed authentication (wrong or missing token)");
  }
  Cursor a(acc, sizeof(acc));
  if (a.get<uint32_t>() != kAuthMagic) throw ProtocolError(where + ": bad magic");
  const auto claimed_pid = static_cast<pid_t>(a.get<uint32_t>());
  const bool server_reads_us = a.get<uint32_t>() == 1;
  const bool server_wants = a.get<uint32_t>() == 1;
  r.send_remote_tensors = o.fast_path && server_reads_us;
  r.read_remote_tensors = may_read_peer(o.fast_path, server_wants, fd, claimed_pid, where);
  if (r.read_remote_tensors) r.peer_pid = claimed_pid;

  Buf confirm;
  confirm.put<uint32_t>(kAuthMagic);
  confirm.put<uint32_t>(r.read_remote_tensors ? 1 : 0);
  seal(confirm, o.token, "tdist-rpc-confirm", nonce_s, nonce_c);
  write_all(fd, confirm.bytes().data(), confirm.bytes().size(), where.c_str());
  set_socket_timeouts(fd, Millis(0));
  return r;
}

}  // namespace tdist::rpc::detail
