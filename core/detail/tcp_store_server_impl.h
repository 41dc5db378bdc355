#pragma once
// The TCPStore server's two classes, shared by its two source files: tcp_store_server.cpp (the
// connections, accepting and the server's life) and tcp_store_server_requests.cpp (the requests
// and the parked waiters). One Boost.Asio io_context on one thread: every connection's state, the
// key-value map and the waiters are touched only from that thread, so none of them needs a lock.
// See Note [TCPStore protocol] in core/tcp_store.cpp. Private to those two files.

#include <boost/asio.hpp>

#include <array>
#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tdist/core/detail/tcp_store_protocol.h"
#include "tdist/core/net/address.h"
#include "tdist/core/net/handshake.h"
#include "tdist/core/wire.h"

namespace tdist::detail {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;
using tcp_store::Command;
using tcp_store::Status;

class TCPStoreConnection;

class TCPStoreServerImpl {
 public:
  TCPStoreServerImpl(const std::string& host, uint16_t port, std::string token);
  ~TCPStoreServerImpl();

  uint16_t port() const { return port_; }
  const std::string& host() const { return host_; }
  int num_connections() const { return num_connections_.load(); }
  int64_t num_rejected_frames() const { return num_rejected_frames_.load(); }
  int64_t num_refused_connections() const { return num_refused_connections_.load(); }
  int64_t num_failed_handshakes() const { return num_failed_handshakes_.load(); }
  uint64_t peak_body_bytes() const { return peak_body_bytes_.load(); }
  std::string address() const { return net::host_port(host_, port_); }
  Millis frame_timeout() const { return frame_timeout_; }
  Millis handshake_timeout() const { return handshake_timeout_; }
  const std::string& token() const { return token_; }

  // Called by connections, on the io thread.
  void handle_request(const std::shared_ptr<TCPStoreConnection>& conn, uint16_t code,
                      wire::Reader& body);
  void on_rejected_frame() { num_rejected_frames_.fetch_add(1); }
  void on_connection_closed(TCPStoreConnection* conn);
  // Logs (the first ten, then one in a thousand) and counts a connection that failed the
  // handshake.
  void on_failed_handshake(const std::string& peer, const std::string& why);
  void on_wait_timeout(const std::shared_ptr<TCPStoreConnection>& conn, uint64_t waiter_id,
                       const error_code& ec);
  // The connection passed its handshake (or closed): its handshake slot is free.
  void on_handshake_over(TCPStoreConnection& conn);
  // Why a request with this (valid) header is refused before its body is read ("" when it is
  // not): a write that could not fit in what the store may still hold, or a body larger than
  // the in-flight budget (Note [TCPStore protocol], limits).
  std::string refusal_before_body(const tcp_store::Header& header) const;
  // Takes `bytes` of the in-flight budget for conn's request body: true when granted now;
  // otherwise conn waits in line and its start_body() is called once the budget has room.
  bool reserve_body(const std::shared_ptr<TCPStoreConnection>& conn, uint64_t bytes);
  // Gives back a reservation (body dispatched or connection closed) and admits who waits.
  void release_body(uint64_t bytes);
  // A buffer whose contents nobody reads: the bodies of refused requests are read into it.
  Bytes& discard_buffer() { return discard_buffer_; }

 private:
  void run();
  void start_accept();
  void on_accept(const error_code& ec, tcp::socket socket);
  void on_accept_retry(const error_code& ec);
  void shutdown();
  // Closes a connection still in its handshake to make room for a new one, logged as a failed
  // handshake.
  void displace(TCPStoreConnection& conn, const std::string& why);

  void on_set(TCPStoreConnection& conn, wire::Reader& body);
  void on_get(const std::shared_ptr<TCPStoreConnection>& conn, wire::Reader& body);
  void on_add(TCPStoreConnection& conn, wire::Reader& body);
  void on_compare_set(TCPStoreConnection& conn, wire::Reader& body);
  void on_wait(const std::shared_ptr<TCPStoreConnection>& conn, wire::Reader& body);
  void on_check(TCPStoreConnection& conn, wire::Reader& body);
  void on_delete(TCPStoreConnection& conn, wire::Reader& body);
  void on_num_keys(TCPStoreConnection& conn, wire::Reader& body);

  std::vector<std::string> missing_keys(const std::vector<std::string>& keys) const;
  // Parks a get/wait until its keys exist (or its timeout passes).
  void park(const std::shared_ptr<TCPStoreConnection>& conn, Command cmd,
            std::vector<std::string> keys, Millis timeout);
  // Answers the parked waiters that `key` completes.
  void on_key_changed(const std::string& key);
  // Removes the connection's waiter from waiting_ and cancels its timer.
  void unpark(TCPStoreConnection& conn);
  // Writes go through these: why storing `value_bytes` at `key` would pass the limits on keys
  // and bytes held ("" when it fits), and the write itself (which keeps held_bytes_).
  std::string over_limit(const std::string& key, size_t value_bytes) const;
  void put(const std::string& key, Bytes value);
  // Replies kInvalid with `why` (the request is refused, the connection stays).
  static void refuse(TCPStoreConnection& conn, const std::string& why);

  // Constant after construction.
  std::string host_;
  uint16_t port_ = 0;
  std::string token_;  // of the connection handshake (empty: none)

  asio::io_context io_;
  tcp::acceptor acceptor_;
  asio::steady_timer accept_retry_timer_;  // paces accept after an error (e.g. out of fds)
  std::thread thread_;
  std::atomic<int> num_connections_{0};
  std::atomic<int64_t> num_rejected_frames_{0};
  std::atomic<int64_t> num_refused_connections_{0};
  std::atomic<int64_t> num_failed_handshakes_{0};
  size_t max_connections_ = 0;  // TDIST_STORE_MAX_CONNECTIONS, or from the descriptor limit
  size_t max_keys_ = 0;          // TDIST_STORE_MAX_KEYS
  uint64_t max_bytes_ = 0;       // TDIST_STORE_MAX_BYTES: keys and values held, together
  Millis frame_timeout_{0};      // TDIST_STORE_FRAME_TIMEOUT_MS: a started frame must end by then
  Millis handshake_timeout_{0};  // TDIST_STORE_HANDSHAKE_TIMEOUT_MS: the handshake must end by then
  size_t max_handshakes_per_address_ = 0;  // TDIST_STORE_MAX_HANDSHAKES_PER_ADDRESS
  uint64_t max_body_bytes_in_flight_ = 0;  // TDIST_STORE_MAX_INFLIGHT_BYTES
  std::atomic<uint64_t> peak_body_bytes_{0};  // the most reserved at once
  Millis dead_peer_timeout_{0};  // TDIST_TCP_USER_TIMEOUT_MS (Note [Vanished hosts])

  // Touched only from the io thread.
  bool stopping_ = false;
  std::unordered_map<std::string, Bytes> data_;
  uint64_t held_bytes_ = 0;  // sizes of data_'s keys and values
  uint64_t largest_entry_bytes_ = 0;  // the largest key + value ever stored (an upper bound)
  // Connections in their handshake, oldest first (by accept number), and how many per address.
  std::map<uint64_t, TCPStoreConnection*> handshakes_;
  std::unordered_map<std::string, size_t> handshakes_per_address_;
  uint64_t next_accept_number_ = 1;
  // Request bodies: bytes reserved now, and the connections waiting for room, first come first.
  uint64_t body_bytes_in_flight_ = 0;
  std::deque<std::shared_ptr<TCPStoreConnection>> waiting_for_budget_;
  Bytes discard_buffer_;
  std::set<std::shared_ptr<TCPStoreConnection>> connections_;
  std::unordered_map<std::string, std::unordered_set<TCPStoreConnection*>> waiting_;
  uint64_t next_waiter_id_ = 1;
};

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
  void arm_frame_deadline() { arm_frame_deadline(server_.frame_timeout()); }
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
