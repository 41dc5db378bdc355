#pragma once
// One accepted connection of the TCPStore server (core/detail/tcp_store_server.h): it runs the
// server side of the connection handshake, reads each request's frame (header, then the body in
// chunks once the server granted its bytes), hands the request to the server and writes the
// replies in order. A frame, once begun, must end within the server's frame timeout, the
// handshake within its handshake timeout (Note [TCPStore protocol] in core/tcp_store.cpp).
//
// Thread safety: none needed; every method runs on the server's io thread. Ownership: the
// server's connection set holds it, and so does every pending Asio handler; close() takes it
// out of the set. Nothing blocks: every read and write is asynchronous.

#include <boost/asio.hpp>

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tdist/core/detail/tcp_store_protocol.h"
#include "tdist/core/net/address.h"
#include "tdist/core/net/handshake.h"
#include "tdist/core/store.h"

namespace tdist::detail {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;
using tcp_store::Command;
using tcp_store::Status;

// A request body is read (or skipped) in chunks of this size.
constexpr size_t kBodyChunkBytes = 64 * 1024;

class TCPStoreServerImpl;

// One accepted socket: reads frames, hands requests to the server, writes replies. Lives while
// the server's connection set or a pending handler holds it.
class TCPStoreConnection : public std::enable_shared_from_this<TCPStoreConnection> {
 public:
  // A get or wait parked until its keys exist.
  struct Waiter {
    uint64_t id = 0;
    Command cmd = Command::kWait;
    std::vector<std::string> keys;
    Millis timeout{0};
    std::unique_ptr<asio::steady_timer> timer;
  };

  TCPStoreConnection(TCPStoreServerImpl& server, tcp::socket socket, uint64_t accept_number)
      : server_(server),
        socket_(std::move(socket)),
        frame_timer_(socket_.get_executor()),
        accept_number_(accept_number) {
    error_code ec;
    auto ep = socket_.remote_endpoint(ec);
    address_ = ec ? std::string("unknown") : ep.address().to_string();
    peer_ = ec ? std::string("unknown peer") : net::host_port(address_, ep.port());
  }

  // Runs the server side of the connection handshake, then reads requests.
  void start();
  void reply(Status status, const Bytes& body);
  // Logs why the peer's bytes cannot be accepted and closes this connection only.
  void reject(const std::string& why);
  void close(bool rejected = false);

  const std::string& peer() const { return peer_; }
  const std::string& address() const { return address_; }  // the peer's IP address
  uint64_t accept_number() const { return accept_number_; }
  bool in_handshake() const { return handshake_.has_value(); }
  bool closed() const { return closed_; }
  uint64_t body_bytes() const { return header_.body_bytes; }
  std::optional<Waiter>& waiter() { return waiter_; }
  // Reads the request body whose budget the server just granted.
  void start_body();

 private:
  void on_challenge_sent(const error_code& ec);
  void on_hello(const error_code& ec, size_t n);
  void read_header();
  void read_header_part();
  void on_header_part(const error_code& ec, size_t n);
  void on_header();
  // A frame whose first byte arrived must be whole within the server's frame timeout: a peer
  // that stalls or trickles inside a frame loses its connection (Note [TCPStore protocol]).
  void arm_frame_deadline(Millis limit);
  void arm_frame_deadline();  // with the server's frame timeout
  void disarm_frame_deadline();
  void read_body_chunk();
  void on_body_chunk(const error_code& ec, size_t n);
  // A request refused from its header: its body is read and dropped, chunk by chunk.
  void skip_body();
  void on_skipped(const error_code& ec, size_t n);
  // The next request is read once the pending replies are written.
  void read_next();
  void dispatch();
  void write_next();
  void on_write(const error_code& ec, size_t n);

  TCPStoreServerImpl& server_;
  tcp::socket socket_;
  asio::steady_timer frame_timer_;
  bool frame_armed_ = false;
  uint64_t frame_generation_ = 0;  // a deadline handler acts only for its own frame
  const uint64_t accept_number_;
  std::string address_;
  std::string peer_;
  bool closed_ = false;
  std::optional<net::ServerHandshake> handshake_;  // set until the handshake is over
  Bytes hello_;
  std::array<uint8_t, tcp_store::kHeaderBytes> header_bytes_{};
  size_t header_received_ = 0;
  tcp_store::Header header_;
  Bytes body_;
  size_t body_received_ = 0;
  uint64_t body_reserved_ = 0;  // of the server's in-flight budget, for body_
  std::deque<Bytes> out_;
  bool read_after_write_ = false;  // the next request is read when out_ drains
  std::optional<Waiter> waiter_;
};

}  // namespace tdist::detail
