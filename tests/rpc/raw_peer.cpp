#include "tests/rpc/raw_peer.h"

#include <gtest/gtest.h>

#include <errno.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "tdist/core/error.h"
#include "tdist/core/net/handshake.h"
#include "tdist/core/serialize.h"
#include "tdist/core/wire.h"
#include "tdist/rpc/signature.h"
#include "tests/harness/process.h"

namespace tdist::rpc::test {

int connect_raw(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TDIST_CHECK(fd >= 0, "socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  TDIST_CHECK(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0, "connect");
  net::set_socket_timeouts(fd, std::chrono::seconds(10));
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

net::Clock::time_point soon() { return net::Clock::now() + std::chrono::seconds(10); }

bool forged_handshake(int fd, const std::string& token, int rank, pid_t pid) {
  Bytes fields;
  wire::Writer w(fields);
  w.u32(static_cast<uint32_t>(rank));
  w.u32(static_cast<uint32_t>(pid));
  w.u32(1);  // wants the fast path
  net::ClientHandshake hs(token, net::Service::kRpc);
  const Bytes theirs = net::client_handshake(fd, hs, fields, 12, soon(), "the agent");
  wire::Reader accept(theirs);
  accept.u32();  // the server's pid
  const bool server_reads_us = accept.u32() == 1;
  Bytes no;
  wire::Writer k(no);
  k.u32(0);  // we do not read the server's memory
  const Bytes confirm = hs.confirm(no);
  net::write_all(fd, confirm.data(), confirm.size(), soon(), "forged handshake: confirmation");
  return server_reads_us;
}

void send_frame(int fd, detail::FrameHeader h, const std::vector<uint8_t>& body) {
  auto b = header_bytes(h);
  b.insert(b.end(), body.begin(), body.end());
  net::write_all(fd, b.data(), b.size(), soon(), "test frame");
}

detail::FrameHeader read_frame(int fd, std::vector<uint8_t>* body, bool skip_offers) {
  for (;;) {
    uint8_t hdr[detail::kHeaderSize];
    net::read_exact(fd, hdr, sizeof(hdr), soon(), "test frame");
    detail::FrameHeader h = detail::decode_header(hdr, uint64_t{1} << 30);
    body->resize(h.length);
    net::read_exact(fd, body->data(), body->size(), soon(), "test frame");
    if (!skip_offers || h.type != detail::MessageType::kStreamOffer) return h;
  }
}

void add_tensor_section(detail::FrameHeader& h, std::vector<uint8_t>& body,
                        const detail::TensorSection& section) {
  const Bytes bytes = encode(section);
  body.insert(body.end(), bytes.begin(), bytes.end());
  h.flags |= detail::kFlagRemoteTensors;
  h.meta_len = static_cast<uint32_t>(bytes.size());
  h.body_len = static_cast<uint32_t>(body.size());
  h.length = body.size();
}

void expect_raw_peer_passes(const std::string& child, uint16_t port) {
  tdist::test::Processes peer(child, 1, {{"AGENT_PORT", std::to_string(port)}});
  auto r = peer.wait_all(std::chrono::seconds(60));
  EXPECT_TRUE(r[0].ok()) << r[0].describe() << "\n" << r[0].output;
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
