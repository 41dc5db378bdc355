// The TCPStore server: one Boost.Asio io_context on one thread. Every connection's state, the
// key-value map and the waiters are touched only from that thread, so none of them needs a lock.
// See Note [TCPStore protocol] in core/tcp_store.cpp.

#include <sys/resource.h>

#include <boost/asio.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "tdist/core/detail/store_util.h"
#include "tdist/core/detail/tcp_store_protocol.h"
#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/net/address.h"
#include "tdist/core/net/handshake.h"
#include "tdist/core/tcp_store.h"
#include "tdist/core/token.h"

namespace tdist {
namespace detail {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;
using tcp_store::Command;
using tcp_store::Status;

constexpr size_t kBodyChunkBytes = 64 * 1024;

// Keys the TCPStore uses for itself (the num_workers join); num_keys() does not count them.
bool is_internal_key(const std::string& key) {
  return key.rfind(tcp_store::kInternalKeyPrefix, 0) == 0;
}

}  // namespace

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
  std::string address() const { return net::host_port(host_, port_); }
  Millis frame_timeout() const { return frame_timeout_; }
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

 private:
  void run();
  void start_accept();
  void on_accept(const error_code& ec, tcp::socket socket);
  void on_accept_retry(const error_code& ec);
  void shutdown();

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

  // Touched only from the io thread.
  bool stopping_ = false;
  std::unordered_map<std::string, Bytes> data_;
  uint64_t held_bytes_ = 0;  // sizes of data_'s keys and values
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

  TCPStoreConnection(TCPStoreServerImpl& server, tcp::socket socket)
      : server_(server), socket_(std::move(socket)), frame_timer_(socket_.get_executor()) {
    error_code ec;
    auto ep = socket_.remote_endpoint(ec);
    peer_ = ec ? std::string("unknown peer") : net::host_port(ep.address().to_string(), ep.port());
  }

  // Runs the server side of the connection handshake, then reads requests.
  void start();
  void reply(Status status, const Bytes& body);
  // Logs why the peer's bytes cannot be accepted and closes this connection only.
  void reject(const std::string& why);
  void close(bool rejected = false);

  const std::string& peer() const { return peer_; }
  std::optional<Waiter>& waiter() { return waiter_; }

 private:
  void on_challenge_sent(const error_code& ec);
  void on_hello(const error_code& ec, size_t n);
  void read_header();
  void read_header_part();
  void on_header_part(const error_code& ec, size_t n);
  void on_header();
  // A frame whose first byte arrived must be whole within the server's frame timeout: a peer
  // that stalls or trickles inside a frame loses its connection (Note [TCPStore protocol]).
  void arm_frame_deadline();
  void disarm_frame_deadline();
  void read_body_chunk();
  void on_body_chunk(const error_code& ec, size_t n);
  void dispatch();
  void write_next();
  void on_write(const error_code& ec, size_t n);

  TCPStoreServerImpl& server_;
  tcp::socket socket_;
  asio::steady_timer frame_timer_;
  bool frame_armed_ = false;
  uint64_t frame_generation_ = 0;  // a deadline handler acts only for its own frame
  std::string peer_;
  bool closed_ = false;
  std::optional<net::ServerHandshake> handshake_;  // set until the handshake is over
  Bytes hello_;
  std::array<uint8_t, tcp_store::kHeaderBytes> header_bytes_{};
  size_t header_received_ = 0;
  tcp_store::Header header_;
  Bytes body_;
  size_t body_received_ = 0;
  std::deque<Bytes> out_;
  bool read_after_write_ = false;  // the next request is read when out_ drains
  std::optional<Waiter> waiter_;
};

// ---- TCPStoreConnection -------------------------------------------------------------------------

void TCPStoreConnection::start() {
  // The handshake is the connection's first frame: it must be over within the frame timeout.
  handshake_.emplace(server_.token(), net::Service::kStore);
  arm_frame_deadline();
  asio::async_write(socket_, asio::buffer(handshake_->challenge()),
                    [self = shared_from_this()](const error_code& ec, size_t) {
                      self->on_challenge_sent(ec);
                    });
}

void TCPStoreConnection::on_challenge_sent(const error_code& ec) {
  if (closed_) return;
  if (ec) {
    TDIST_LOG_DEBUG("TCPStore server ", server_.address(), ": ", peer_, " left before the ",
                    "handshake (", ec.message(), ")");
    close();
    return;
  }
  hello_.resize(net::hello_bytes(0));
  asio::async_read(socket_, asio::buffer(hello_),
                   [self = shared_from_this()](const error_code& ec, size_t n) {
                     self->on_hello(ec, n);
                   });
}

void TCPStoreConnection::on_hello(const error_code& ec, size_t n) {
  if (closed_) return;
  std::string why;
  if (ec && n == 0) {
    // Connected and left without a word (a port probe): not worth a warning.
    TDIST_LOG_DEBUG("TCPStore server ", server_.address(), ": ", peer_, " left before the ",
                    "handshake (", ec.message(), ")");
    close();
    return;
  }
  if (ec) {
    why = str("the connection ended after ", n, " of ", hello_.size(), " hello bytes");
  } else {
    try {
      handshake_->verify_hello(hello_.data(), hello_.size(), 0);
    } catch (const ProtocolError& e) {
      why = e.what();
    }
  }
  if (!why.empty()) {
    server_.on_failed_handshake(peer_, why);
    close(/*rejected=*/true);
    return;
  }
  disarm_frame_deadline();
  out_.push_back(handshake_->accept({}));
  handshake_.reset();
  hello_ = Bytes();
  read_after_write_ = true;  // requests are read once the acceptance is written
  write_next();
}

void TCPStoreConnection::read_header() {
  header_received_ = 0;
  read_header_part();
}

void TCPStoreConnection::read_header_part() {
  socket_.async_read_some(
      asio::buffer(header_bytes_.data() + header_received_, header_bytes_.size() - header_received_),
      [self = shared_from_this()](const error_code& ec, size_t n) { self->on_header_part(ec, n); });
}

void TCPStoreConnection::on_header_part(const error_code& ec, size_t n) {
  if (closed_) return;
  header_received_ += n;
  if (ec) {
    if (header_received_ > 0) {
      reject(str("connection ended inside a frame header (", header_received_, " of ",
                 header_bytes_.size(), " bytes)"));
    } else {
      TDIST_LOG_DEBUG("TCPStore server ", server_.address(), ": ", peer_, " disconnected (",
                      ec.message(), ")");
      close();
    }
    return;
  }
  if (header_received_ < header_bytes_.size()) {
    arm_frame_deadline();
    read_header_part();
    return;
  }
  on_header();
}

void TCPStoreConnection::arm_frame_deadline() {
  if (frame_armed_) return;
  frame_armed_ = true;
  const uint64_t generation = ++frame_generation_;
  frame_timer_.expires_after(server_.frame_timeout());
  frame_timer_.async_wait([self = shared_from_this(), generation](const error_code& ec) {
    if (ec || self->closed_ || !self->frame_armed_ || self->frame_generation_ != generation) return;
    if (self->handshake_) {
      self->server_.on_failed_handshake(
          self->peer_, str("the handshake was not over within ",
                           seconds_text(self->server_.frame_timeout()),
                           " s (TDIST_STORE_FRAME_TIMEOUT_MS)"));
      self->close(/*rejected=*/true);
      return;
    }
    const bool in_header = self->header_received_ < self->header_bytes_.size();
    self->reject(str("the peer stalled inside a frame for ",
                     seconds_text(self->server_.frame_timeout()), " s (TDIST_STORE_FRAME_TIMEOUT_MS), ",
                     in_header ? str("after ", self->header_received_, " of ",
                                     self->header_bytes_.size(), " header bytes")
                               : str("in the ", self->header_.body_bytes, "-byte body of '",
                                     tcp_store::command_name(self->header_.code), "'")));
  });
}

void TCPStoreConnection::disarm_frame_deadline() {
  if (!frame_armed_) return;
  frame_armed_ = false;
  ++frame_generation_;
  frame_timer_.cancel();
}

void TCPStoreConnection::on_header() {
  header_ = tcp_store::decode_header(header_bytes_.data());
  // Validated before a single byte of the body is read or allocated.
  std::string problem = tcp_store::header_problem(header_, TCPStoreServer::kMaxFrameBytes);
  if (problem.empty() && !tcp_store::is_known_command(header_.code)) {
    problem = str("unknown command ", header_.code);
  }
  if (problem.empty() && waiter_) {
    // A client sends one request at a time; this one arrived before the parked one was answered.
    problem = str("request '", tcp_store::command_name(header_.code), "' arrived while '",
                  tcp_store::command_name(static_cast<uint16_t>(waiter_->cmd)),
                  "' is still pending");
  }
  if (!problem.empty()) {
    reject(problem);
    return;
  }
  body_.clear();
  body_received_ = 0;
  if (header_.body_bytes == 0) {
    dispatch();
  } else {
    arm_frame_deadline();
    read_body_chunk();
  }
}

void TCPStoreConnection::read_body_chunk() {
  // The body grows as bytes arrive, so a peer that announces a large body but sends little
  // cannot make the server allocate what it announced.
  const size_t chunk = static_cast<size_t>(
      std::min<uint64_t>(header_.body_bytes - body_received_, kBodyChunkBytes));
  body_.resize(body_received_ + chunk);
  asio::async_read(socket_, asio::buffer(body_.data() + body_received_, chunk),
                   [self = shared_from_this()](const error_code& ec, size_t n) {
                     self->on_body_chunk(ec, n);
                   });
}

void TCPStoreConnection::on_body_chunk(const error_code& ec, size_t n) {
  if (closed_) return;
  if (ec) {
    reject(str("connection ended inside the body of '", tcp_store::command_name(header_.code),
               "' (", body_received_ + n, " of ", header_.body_bytes, " bytes)"));
    return;
  }
  body_received_ += n;
  if (body_received_ < header_.body_bytes) {
    read_body_chunk();
  } else {
    dispatch();
  }
}

void TCPStoreConnection::dispatch() {
  disarm_frame_deadline();
  auto self = shared_from_this();
  try {
    wire::Reader reader(body_);
    server_.handle_request(self, header_.code, reader);
  } catch (const ProtocolError& e) {
    reject(str("malformed '", tcp_store::command_name(header_.code), "' request: ", e.what()));
    return;
  }
  body_ = Bytes();
  if (closed_) return;
  // Backpressure: the next request is read only once this one's reply is written, so a peer
  // that pipelines requests without reading the replies holds at most one reply here (the
  // rest wait in its socket). A parked get/wait has no reply yet: read on, which is how a
  // peer's disconnect is noticed (and a request that comes before the answer is rejected).
  if (out_.empty()) {
    read_header();
  } else {
    read_after_write_ = true;
  }
}

void TCPStoreConnection::reply(Status status, const Bytes& body) {
  if (closed_) return;
  out_.push_back(tcp_store::make_frame(static_cast<uint16_t>(status), body));
  if (out_.size() == 1) write_next();
}

void TCPStoreConnection::write_next() {
  asio::async_write(socket_, asio::buffer(out_.front()),
                    [self = shared_from_this()](const error_code& ec, size_t n) {
                      self->on_write(ec, n);
                    });
}

void TCPStoreConnection::on_write(const error_code& ec, size_t /*n*/) {
  if (closed_) return;
  if (ec) {
    TDIST_LOG_DEBUG("TCPStore server ", server_.address(), ": write to ", peer_, " failed (",
                    ec.message(), ")");
    close();
    return;
  }
  out_.pop_front();
  if (!out_.empty()) {
    write_next();
  } else if (read_after_write_) {
    read_after_write_ = false;
    read_header();
  }
}

void TCPStoreConnection::reject(const std::string& why) {
  TDIST_LOG_ERROR("TCPStore server ", server_.address(), ": closing the connection from ",
                  peer_, ": ", why);
  close(/*rejected=*/true);
}

void TCPStoreConnection::close(bool rejected) {
  if (closed_) return;
  closed_ = true;
  // Counted before the socket closes: whoever sees the end of the stream also sees the count.
  if (rejected) server_.on_rejected_frame();
  error_code ignored;
  socket_.shutdown(tcp::socket::shutdown_both, ignored);
  socket_.close(ignored);
  disarm_frame_deadline();
  out_.clear();
  server_.on_connection_closed(this);
}

// ---- TCPStoreServerImpl -------------------------------------------------------------------------

namespace {

// Connections the server keeps open at most: TDIST_STORE_MAX_CONNECTIONS, by default 3/4 of the
// process's descriptor limit (the rest stays for the process itself), at least 64.
size_t connection_limit() {
  rlimit rl{};
  int64_t fallback = 1024;
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    fallback = static_cast<int64_t>(rl.rlim_cur);
  }
  fallback = std::clamp<int64_t>(fallback * 3 / 4, 64, int64_t(1) << 20);
  return static_cast<size_t>(
      env::get_int("TDIST_STORE_MAX_CONNECTIONS", fallback, 1, int64_t(1) << 20));
}

constexpr int64_t kDefaultMaxKeys = int64_t(1) << 20;
constexpr int64_t kDefaultMaxBytes = int64_t(4) << 30;
constexpr int64_t kDefaultFrameTimeoutMs = 60000;

}  // namespace

TCPStoreServerImpl::TCPStoreServerImpl(const std::string& host, uint16_t port, std::string token)
    : host_(host),
      token_(std::move(token)),
      acceptor_(io_),
      accept_retry_timer_(io_),
      max_connections_(connection_limit()),
      max_keys_(static_cast<size_t>(
          env::get_int("TDIST_STORE_MAX_KEYS", kDefaultMaxKeys, 1, int64_t(1) << 40))),
      max_bytes_(static_cast<uint64_t>(
          env::get_int("TDIST_STORE_MAX_BYTES", kDefaultMaxBytes, 1, int64_t(1) << 50))),
      frame_timeout_(
          env::get_int("TDIST_STORE_FRAME_TIMEOUT_MS", kDefaultFrameTimeoutMs, 1, int64_t(1) << 40)) {
  try {
    tcp::resolver resolver(io_);
    auto results = resolver.resolve(host, std::to_string(port),
                                    tcp::resolver::passive | tcp::resolver::numeric_service);
    tcp::endpoint endpoint = results.begin()->endpoint();
    acceptor_.open(endpoint.protocol());
    acceptor_.set_option(tcp::acceptor::reuse_address(true));
    acceptor_.bind(endpoint);
    acceptor_.listen(asio::socket_base::max_listen_connections);
    port_ = acceptor_.local_endpoint().port();
  } catch (const boost::system::system_error& e) {
    TDIST_THROW(NetworkError, "TCPStore server cannot listen on ", net::host_port(host, port), ": ",
                e.code().message());
  }
  start_accept();
  thread_ = std::thread([this] { run(); });
  TDIST_LOG_DEBUG("TCPStore server listening on ", address());
}

TCPStoreServerImpl::~TCPStoreServerImpl() {
  // shutdown() runs on the io thread (connection state lives there) and stops the loop; the loop
  // never blocks, so the join cannot hang even with clients connected or parked in get/wait.
  asio::post(io_, [this] { shutdown(); });
  if (thread_.joinable()) thread_.join();
}

void TCPStoreServerImpl::run() {
  for (;;) {
    try {
      io_.run();
      return;
    } catch (const std::exception& e) {
      // Handlers catch what a peer can cause; anything else is a bug, but keep serving.
      TDIST_LOG_ERROR("TCPStore server ", address(), ": unexpected error: ", e.what());
    }
  }
}

void TCPStoreServerImpl::shutdown() {
  stopping_ = true;
  error_code ignored;
  acceptor_.close(ignored);
  accept_retry_timer_.cancel();
  auto conns = connections_;  // close() erases from connections_
  for (const auto& c : conns) c->close();
  io_.stop();
}

void TCPStoreServerImpl::start_accept() {
  acceptor_.async_accept([this](const error_code& ec, tcp::socket socket) {
    on_accept(ec, std::move(socket));
  });
}

void TCPStoreServerImpl::on_accept(const error_code& ec, tcp::socket socket) {
  if (stopping_ || ec == asio::error::operation_aborted) return;
  if (ec) {
    TDIST_LOG_WARN("TCPStore server ", address(), ": accept failed: ", ec.message());
    accept_retry_timer_.expires_after(std::chrono::milliseconds(100));
    accept_retry_timer_.async_wait([this](const error_code& e) { on_accept_retry(e); });
    return;
  }
  if (connections_.size() >= max_connections_) {
    // Over the cap: closed at once (the peer sees end-of-file), logged once per refusal burst.
    // Counted before the close, so a peer that saw the end-of-file finds it counted.
    const int64_t refused = num_refused_connections_.fetch_add(1);
    error_code ignored;
    socket.close(ignored);
    if (refused % 1000 == 0) {
      TDIST_LOG_ERROR("TCPStore server ", address(), ": refusing connections beyond the limit of ",
                      max_connections_, " (TDIST_STORE_MAX_CONNECTIONS); ",
                      num_refused_connections_.load(), " refused so far");
    }
    start_accept();
    return;
  }
  {
    error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);
    auto conn = std::make_shared<TCPStoreConnection>(*this, std::move(socket));
    connections_.insert(conn);
    num_connections_.fetch_add(1);
    TDIST_LOG_DEBUG("TCPStore server ", address(), ": accepted ", conn->peer());
    conn->start();
  }
  start_accept();
}

void TCPStoreServerImpl::on_accept_retry(const error_code& ec) {
  if (stopping_ || ec == asio::error::operation_aborted) return;
  start_accept();
}

void TCPStoreServerImpl::on_failed_handshake(const std::string& peer, const std::string& why) {
  const int64_t n = num_failed_handshakes_.fetch_add(1) + 1;
  if (n <= 10 || n % 1000 == 0) {
    TDIST_LOG_WARN("TCPStore server ", address(), ": refused the connection from ", peer, ": ",
                   why, " (", n, " refused handshakes so far)");
  }
}

void TCPStoreServerImpl::on_connection_closed(TCPStoreConnection* conn) {
  unpark(*conn);
  auto it = std::find_if(connections_.begin(), connections_.end(),
                         [conn](const auto& c) { return c.get() == conn; });
  if (it != connections_.end()) {
    connections_.erase(it);
    num_connections_.fetch_sub(1);
  }
}

void TCPStoreServerImpl::handle_request(const std::shared_ptr<TCPStoreConnection>& conn,
                                        uint16_t code, wire::Reader& body) {
  switch (static_cast<Command>(code)) {
    case Command::kSet: return on_set(*conn, body);
    case Command::kGet: return on_get(conn, body);
    case Command::kAdd: return on_add(*conn, body);
    case Command::kCompareSet: return on_compare_set(*conn, body);
    case Command::kWait: return on_wait(conn, body);
    case Command::kCheck: return on_check(*conn, body);
    case Command::kDelete: return on_delete(*conn, body);
    case Command::kNumKeys: return on_num_keys(*conn, body);
  }
  throw ProtocolError(str("unknown command ", code));
}

namespace {

Millis read_timeout(wire::Reader& r) {
  int64_t ms = r.i64("timeout");
  if (ms < 0) throw ProtocolError(str("negative timeout ", ms, " ms"));
  return effective_timeout(Millis(ms));
}

Bytes encode_keys(const std::vector<std::string>& keys) {
  Bytes out;
  wire::Writer w(out);
  tcp_store::write_keys(w, keys);
  return out;
}

}  // namespace

void TCPStoreServerImpl::on_set(TCPStoreConnection& conn, wire::Reader& body) {
  std::string key = body.string("key");
  Bytes value = body.blob("value");
  body.expect_end("set request");
  if (auto why = over_limit(key, value.size()); !why.empty()) return refuse(conn, why);
  put(key, std::move(value));
  conn.reply(Status::kOk, {});
  on_key_changed(key);
}

void TCPStoreServerImpl::on_get(const std::shared_ptr<TCPStoreConnection>& conn,
                                wire::Reader& body) {
  std::string key = body.string("key");
  Millis timeout = read_timeout(body);
  body.expect_end("get request");
  auto it = data_.find(key);
  if (it != data_.end()) {
    Bytes out;
    wire::Writer(out).blob(it->second);
    conn->reply(Status::kOk, out);
    return;
  }
  park(conn, Command::kGet, {key}, timeout);
}

void TCPStoreServerImpl::on_add(TCPStoreConnection& conn, wire::Reader& body) {
  std::string key = body.string("key");
  int64_t delta = body.i64("delta");
  body.expect_end("add request");
  int64_t value = 0;
  auto it = data_.find(key);
  try {
    if (it != data_.end()) value = parse_counter(key, it->second);
  } catch (const InvalidArgument& e) {
    return refuse(conn, e.what());
  }
  if (__builtin_add_overflow(value, delta, &value)) {
    return refuse(conn, str("add(", delta, ") overflows the counter in store key '", key, "'"));
  }
  Bytes text = to_bytes(std::to_string(value));
  if (auto why = over_limit(key, text.size()); !why.empty()) return refuse(conn, why);
  put(key, std::move(text));
  Bytes out;
  wire::Writer(out).i64(value);
  conn.reply(Status::kOk, out);
  on_key_changed(key);
}

void TCPStoreServerImpl::on_compare_set(TCPStoreConnection& conn, wire::Reader& body) {
  std::string key = body.string("key");
  Bytes expected = body.blob("expected");
  Bytes desired = body.blob("desired");
  body.expect_end("compare_set request");
  Bytes result;
  bool changed = false;
  auto it = data_.find(key);
  const bool swap = it == data_.end() ? expected.empty() : it->second == expected;
  if (swap) {
    if (auto why = over_limit(key, desired.size()); !why.empty()) return refuse(conn, why);
    put(key, desired);
    result = desired;
    changed = true;
  } else {
    result = it == data_.end() ? expected : it->second;
  }
  Bytes out;
  wire::Writer(out).blob(result);
  conn.reply(Status::kOk, out);
  if (changed) on_key_changed(key);
}

void TCPStoreServerImpl::on_wait(const std::shared_ptr<TCPStoreConnection>& conn,
                                 wire::Reader& body) {
  std::vector<std::string> keys = tcp_store::read_keys(body);
  Millis timeout = read_timeout(body);
  body.expect_end("wait request");
  if (missing_keys(keys).empty()) {
    conn->reply(Status::kOk, {});
    return;
  }
  park(conn, Command::kWait, std::move(keys), timeout);
}

void TCPStoreServerImpl::on_check(TCPStoreConnection& conn, wire::Reader& body) {
  std::vector<std::string> keys = tcp_store::read_keys(body);
  body.expect_end("check request");
  Bytes out;
  wire::Writer(out).u8(missing_keys(keys).empty() ? 1 : 0);
  conn.reply(Status::kOk, out);
}

void TCPStoreServerImpl::on_delete(TCPStoreConnection& conn, wire::Reader& body) {
  std::string key = body.string("key");
  body.expect_end("delete_key request");
  auto it = data_.find(key);
  const bool found = it != data_.end();
  if (found) {
    held_bytes_ -= key.size() + it->second.size();
    data_.erase(it);
  }
  Bytes out;
  wire::Writer(out).u8(found ? 1 : 0);
  conn.reply(Status::kOk, out);
}

void TCPStoreServerImpl::on_num_keys(TCPStoreConnection& conn, wire::Reader& body) {
  body.expect_end("num_keys request");
  int64_t n = 0;
  for (const auto& kv : data_)
    if (!is_internal_key(kv.first)) ++n;
  Bytes out;
  wire::Writer(out).i64(n);
  conn.reply(Status::kOk, out);
}

std::string TCPStoreServerImpl::over_limit(const std::string& key, size_t value_bytes) const {
  auto it = data_.find(key);
  const uint64_t freed = it == data_.end() ? 0 : key.size() + it->second.size();
  if (it == data_.end() && data_.size() >= max_keys_) {
    return str("the store at ", address(), " holds ", data_.size(), " keys, its limit ",
               "(TDIST_STORE_MAX_KEYS); setting the new key '", key, "' is refused");
  }
  if (held_bytes_ - freed + key.size() + value_bytes > max_bytes_) {
    return str("the store at ", address(), " holds ", held_bytes_, " bytes of keys and values; ",
               "storing ", value_bytes, " bytes at '", key, "' would pass its limit of ",
               max_bytes_, " (TDIST_STORE_MAX_BYTES)");
  }
  return {};
}

void TCPStoreServerImpl::put(const std::string& key, Bytes value) {
  auto [it, inserted] = data_.try_emplace(key);
  if (!inserted) held_bytes_ -= key.size() + it->second.size();
  held_bytes_ += key.size() + value.size();
  it->second = std::move(value);
}

void TCPStoreServerImpl::refuse(TCPStoreConnection& conn, const std::string& why) {
  Bytes out;
  wire::Writer(out).string(why);
  conn.reply(Status::kInvalid, out);
}

std::vector<std::string> TCPStoreServerImpl::missing_keys(
    const std::vector<std::string>& keys) const {
  std::vector<std::string> missing;
  for (const auto& k : keys)
    if (!data_.count(k)) missing.push_back(k);
  return missing;
}

void TCPStoreServerImpl::park(const std::shared_ptr<TCPStoreConnection>& conn, Command cmd,
                              std::vector<std::string> keys, Millis timeout) {
  TCPStoreConnection::Waiter w;
  w.id = next_waiter_id_++;
  w.cmd = cmd;
  w.keys = std::move(keys);
  w.timeout = timeout;
  for (const auto& k : missing_keys(w.keys)) waiting_[k].insert(conn.get());
  if (timeout != Store::kNoTimeout) {
    w.timer = std::make_unique<asio::steady_timer>(io_, timeout);
    w.timer->async_wait([this, conn, id = w.id](const error_code& ec) {
      on_wait_timeout(conn, id, ec);
    });
  }
  conn->waiter() = std::move(w);
}

void TCPStoreServerImpl::unpark(TCPStoreConnection& conn) {
  auto& waiter = conn.waiter();
  if (!waiter) return;
  for (const auto& k : waiter->keys) {
    auto it = waiting_.find(k);
    if (it == waiting_.end()) continue;
    it->second.erase(&conn);
    if (it->second.empty()) waiting_.erase(it);
  }
  if (waiter->timer) waiter->timer->cancel();
  waiter.reset();
}

void TCPStoreServerImpl::on_key_changed(const std::string& key) {
  auto it = waiting_.find(key);
  if (it == waiting_.end()) return;
  std::vector<TCPStoreConnection*> parked(it->second.begin(), it->second.end());
  for (TCPStoreConnection* raw : parked) {
    auto& waiter = raw->waiter();
    if (!waiter || !missing_keys(waiter->keys).empty()) continue;
    const Command cmd = waiter->cmd;
    const std::string first = waiter->keys.front();
    unpark(*raw);
    Bytes out;
    if (cmd == Command::kGet) wire::Writer(out).blob(data_.at(first));
    raw->reply(Status::kOk, out);
  }
}

void TCPStoreServerImpl::on_wait_timeout(const std::shared_ptr<TCPStoreConnection>& conn,
                                         uint64_t waiter_id, const error_code& ec) {
  auto& waiter = conn->waiter();
  if (ec == asio::error::operation_aborted || !waiter || waiter->id != waiter_id) return;
  std::vector<std::string> missing = missing_keys(waiter->keys);
  TDIST_LOG_DEBUG("TCPStore server ", address(), ": ",
                  tcp_store::command_name(static_cast<uint16_t>(waiter->cmd)), " from ",
                  conn->peer(), " timed out after ", seconds_text(waiter->timeout),
                  " s; missing ", join_keys(missing));
  unpark(*conn);
  conn->reply(Status::kTimeout, encode_keys(missing));
}

}  // namespace detail

// ---- TCPStoreServer -----------------------------------------------------------------------------

TCPStoreServer::TCPStoreServer(const std::string& host, uint16_t port,
                               const std::optional<std::string>& token)
    : impl_(std::make_unique<detail::TCPStoreServerImpl>(
          host, port, resolve_token(token, "the TCPStoreServer's token").value)) {}

TCPStoreServer::~TCPStoreServer() = default;

uint16_t TCPStoreServer::port() const { return impl_->port(); }

const std::string& TCPStoreServer::host() const { return impl_->host(); }

int TCPStoreServer::num_connections() const { return impl_->num_connections(); }

int64_t TCPStoreServer::num_rejected_frames() const { return impl_->num_rejected_frames(); }

int64_t TCPStoreServer::num_refused_connections() const { return impl_->num_refused_connections(); }

int64_t TCPStoreServer::num_failed_handshakes() const { return impl_->num_failed_handshakes(); }

}  // namespace tdist
