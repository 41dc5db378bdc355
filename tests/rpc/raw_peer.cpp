#include "tests/rpc/raw_peer.h"

#include <errno.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "tdist/core/error.h"
#include "tdist/core/serialize.h"
#include "tdist/rpc/signature.h"

namespace tdist::rpc::test {
namespace {

template <class T>
void put(std::vector<uint8_t>& b, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  b.insert(b.end(), p, p + sizeof(T));
}

// HMAC-SHA256(token, label | fields | n1 | n2), appended to `fields`.
void seal(std::vector<uint8_t>& fields, const std::string& token, const char* label,
          const uint8_t* n1, const uint8_t* n2) {
  std::vector<uint8_t> data(label, label + std::strlen(label));
  data.insert(data.end(), fields.begin(), fields.end());
  data.insert(data.end(), n1, n1 + 32);
  if (n2) data.insert(data.end(), n2, n2 + 32);
  auto mac = detail::hmac_sha256(token, data.data(), data.size());
  fields.insert(fields.end(), mac.begin(), mac.end());
}

}  // namespace

int connect_raw(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TDIST_CHECK(fd >= 0, "socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  TDIST_CHECK(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0, "connect");
  detail::set_socket_timeouts(fd, std::chrono::seconds(10));
  return fd;
}

bool closed_by_peer(int fd) {
  char buf[4096];
  for (;;) {
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n == 0) return true;
    if (n < 0) return errno == ECONNRESET || errno == EPIPE;
  }
}

bool closed_now(int fd) {
  char buf[4096];
  for (;;) {
    ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0) return errno == ECONNRESET || errno == EPIPE;
  }
}

void send_bytes(int fd, const void* data, size_t n) { ::send(fd, data, n, MSG_NOSIGNAL); }

std::vector<uint8_t> header_bytes(detail::FrameHeader h, uint32_t magic) {
  std::vector<uint8_t> b(detail::kHeaderSize);
  detail::encode_header(h, b.data());
  std::memcpy(b.data(), &magic, 4);
  return b;
}

detail::HandshakeOptions raw_options(const std::string& token, int rank) {
  detail::HandshakeOptions o;
  o.token = token;
  o.my_rank = rank;
  o.world_size = 2;
  o.fast_path = false;
  o.timeout = std::chrono::seconds(10);
  return o;
}

bool forged_handshake(int fd, const std::string& token, int rank, pid_t pid) {
  uint8_t ch[40];
  detail::read_exact(fd, ch, sizeof(ch), "forged handshake: challenge");
  const uint8_t* nonce_s = ch + 8;
  uint8_t nonce_c[32];
  for (int i = 0; i < 32; ++i) nonce_c[i] = static_cast<uint8_t>(i * 37 + rank);
  std::vector<uint8_t> resp;
  put<uint32_t>(resp, 0x54554154);
  put<uint16_t>(resp, 2);
  put<uint16_t>(resp, 0);
  put<int32_t>(resp, rank);
  resp.insert(resp.end(), nonce_c, nonce_c + 32);
  put<uint32_t>(resp, static_cast<uint32_t>(pid));
  put<uint32_t>(resp, 1);  // wants the fast path
  seal(resp, token, "tdist-rpc-client", nonce_s, nullptr);
  detail::write_all(fd, resp.data(), resp.size(), "forged handshake: response");
  uint8_t acc[48];
  detail::read_exact(fd, acc, sizeof(acc), "forged handshake: acceptance");
  uint32_t server_reads_us = 0;
  std::memcpy(&server_reads_us, acc + 8, 4);
  std::vector<uint8_t> confirm;
  put<uint32_t>(confirm, 0x54554154);
  put<uint32_t>(confirm, 0);  // we do not read the server's memory
  seal(confirm, token, "tdist-rpc-confirm", nonce_s, nonce_c);
  detail::write_all(fd, confirm.data(), confirm.size(), "forged handshake: confirmation");
  return server_reads_us == 1;
}

void send_frame(int fd, detail::FrameHeader h, const std::vector<uint8_t>& body) {
  auto b = header_bytes(h);
  b.insert(b.end(), body.begin(), body.end());
  detail::write_all(fd, b.data(), b.size(), "test frame");
}

detail::FrameHeader read_frame(int fd, std::vector<uint8_t>* body) {
  uint8_t hdr[detail::kHeaderSize];
  detail::read_exact(fd, hdr, sizeof(hdr), "test frame");
  detail::FrameHeader h = detail::decode_header(hdr, uint64_t{1} << 30);
  body->resize(h.length);
  detail::read_exact(fd, body->data(), body->size(), "test frame");
  return h;
}

detail::FrameHeader add_call(uint64_t id, std::vector<uint8_t>* body) {
  *body = encode(detail::CallHeader{"add", signature_of<int64_t, int64_t, int64_t>().hash},
                 int64_t{20}, int64_t{22});
  detail::FrameHeader h;
  h.type = detail::MessageType::kCall;
  h.id = id;
  h.body_len = static_cast<uint32_t>(body->size());
  h.length = body->size();
  return h;
}

}  // namespace tdist::rpc::test
