// The TCPStore server, part 1 of 2: the connections (handshake, framing, replies), accepting, and
// the server's life. The classes are in tcp_store_server_impl.h; the requests and the parked
// waiters are part 2, tcp_store_server_requests.cpp.

#include <sys/resource.h>

#include <algorithm>
#include <mutex>
#include <utility>

#include "tdist/core/detail/store_util.h"
#include "tdist/core/detail/tcp_store_server_impl.h"
#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/tcp_store.h"
#include "tdist/core/token.h"

namespace tdist {
namespace detail {
namespace {

constexpr size_t kBodyChunkBytes = 64 * 1024;

}  // namespace

// ---- TCPStoreConnection -------------------------------------------------------------------------

void TCPStoreConnection::start() {
  // The handshake must be over within the handshake timeout (short: it costs a client two round
  // trips, and a stranger that stalls holds one of its address's few slots meanwhile).
  handshake_.emplace(server_.token(), net::Service::kStore);
  arm_frame_deadline(server_.handshake_timeout());
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
  server_.on_handshake_over(*this);
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

void TCPStoreConnection::arm_frame_deadline(Millis limit) {
  if (frame_armed_) return;
  frame_armed_ = true;
  const uint64_t generation = ++frame_generation_;
  frame_timer_.expires_after(limit);
  frame_timer_.async_wait([self = shared_from_this(), generation](const error_code& ec) {
    if (ec || self->closed_ || !self->frame_armed_ || self->frame_generation_ != generation) return;
    if (self->handshake_) {
      self->server_.on_failed_handshake(
          self->peer_, str("the handshake was not over within ",
                           seconds_text(self->server_.handshake_timeout()),
                           " s (TDIST_STORE_HANDSHAKE_TIMEOUT_MS)"));
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
  // The header is whole: a body's deadline starts when its reading does (a body that waits for
  // the in-flight budget waits on other peers, not on this one).
  disarm_frame_deadline();
  if (header_.body_bytes == 0) {
    dispatch();
    return;
  }
  if (std::string why = server_.refusal_before_body(header_); !why.empty()) {
    // A well-formed request that cannot be done: refused now, its body skipped unbuffered.
    Bytes out;
    wire::Writer(out).string(why);
    reply(Status::kInvalid, out);
    skip_body();
    return;
  }
  // Waits here, reading nothing, while other connections' bodies use the in-flight budget.
  if (server_.reserve_body(shared_from_this(), header_.body_bytes)) start_body();
}

void TCPStoreConnection::start_body() {
  // The budget is taken for the whole body; the buffer grows as bytes arrive
  // (read_body_chunk), so announcing a body allocates nothing.
  body_reserved_ = header_.body_bytes;
  arm_frame_deadline();
  read_body_chunk();
}

void TCPStoreConnection::skip_body() {
  arm_frame_deadline();
  Bytes& sink = server_.discard_buffer();
  const size_t chunk = static_cast<size_t>(
      std::min<uint64_t>(header_.body_bytes - body_received_, sink.size()));
  asio::async_read(socket_, asio::buffer(sink.data(), chunk),
                   [self = shared_from_this()](const error_code& ec, size_t n) {
                     self->on_skipped(ec, n);
                   });
}

void TCPStoreConnection::on_skipped(const error_code& ec, size_t n) {
  if (closed_) return;
  if (ec) {
    reject(str("connection ended inside the body of a refused '",
               tcp_store::command_name(header_.code), "' (", body_received_ + n, " of ",
               header_.body_bytes, " bytes)"));
    return;
  }
  body_received_ += n;
  if (body_received_ < header_.body_bytes) {
    skip_body();
    return;
  }
  disarm_frame_deadline();
  read_next();
}

void TCPStoreConnection::read_body_chunk() {
  // The body grows as bytes arrive, so a peer that announces a large body but sends nothing
  // makes the server allocate nothing; after a first chunk the announced size is reserved
  // (address space; pages are touched as bytes land), within the in-flight budget.
  const size_t chunk = static_cast<size_t>(
      std::min<uint64_t>(header_.body_bytes - body_received_, kBodyChunkBytes));
  // Reserving at once keeps a large body from being copied over and over as the buffer doubles.
  if (body_received_ > 0 && body_.capacity() < header_.body_bytes) {
    body_.reserve(static_cast<size_t>(header_.body_bytes));
  }
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
  if (body_reserved_ > 0) {
    server_.release_body(std::exchange(body_reserved_, 0));
  }
  if (closed_) return;
  read_next();
}

void TCPStoreConnection::read_next() {
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
  body_ = Bytes();
  if (body_reserved_ > 0) server_.release_body(std::exchange(body_reserved_, 0));
  server_.on_connection_closed(this);
}

// ---- TCPStoreServerImpl -------------------------------------------------------------------------

namespace {

// Note [Secure by default]: a server that listens beyond loopback without a token lets anyone
// who reaches it read and change every key of the job (addresses, the run's state). Refused,
// naming the ways out, unless TDIST_ALLOW_NO_TOKEN=1 (tdist-run --insecure), which is said once
// per process, loudly. Loopback needs no token: only this host's users reach it.
void require_token_beyond_loopback(const std::string& token, const std::string& host,
                                   uint16_t port) {
  if (!token.empty() || net::is_loopback_host(host)) return;
  TDIST_CHECK_ARG(env::get_bool("TDIST_ALLOW_NO_TOKEN", false), "the TCPStore server would listen on ",
                  net::host_port(host, port), ", beyond loopback, without a token: set "
                  "TDIST_TOKEN or TDIST_TOKEN_FILE (or TCPStoreOptions::token) on every process "
                  "of the job, or set TDIST_ALLOW_NO_TOKEN=1 (tdist-run --insecure) to run without");
  static std::once_flag said;
  std::call_once(said, [&] {
    TDIST_LOG_WARN("TCPStore server on ", net::host_port(host, port), " runs WITHOUT A TOKEN ",
                   "(TDIST_ALLOW_NO_TOKEN=1): anyone who can reach it can read and change every ",
                   "key of the job");
  });
}

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
constexpr int64_t kDefaultHandshakeTimeoutMs = 10000;
constexpr int64_t kDefaultHandshakesPerAddress = 16;

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
          env::get_int("TDIST_STORE_FRAME_TIMEOUT_MS", kDefaultFrameTimeoutMs, 1, int64_t(1) << 40)),
      handshake_timeout_(env::get_int("TDIST_STORE_HANDSHAKE_TIMEOUT_MS",
                                      kDefaultHandshakeTimeoutMs, 1, int64_t(1) << 40)),
      max_handshakes_per_address_(static_cast<size_t>(
          env::get_int("TDIST_STORE_MAX_HANDSHAKES_PER_ADDRESS", kDefaultHandshakesPerAddress, 1,
                       int64_t(1) << 20))),
      max_body_bytes_in_flight_(static_cast<uint64_t>(
          env::get_int("TDIST_STORE_MAX_INFLIGHT_BYTES",
                       static_cast<int64_t>(TCPStoreServer::kMaxFrameBytes), 1, int64_t(1) << 50))),
      dead_peer_timeout_(net::dead_peer_timeout()),
      discard_buffer_(kBodyChunkBytes) {
  require_token_beyond_loopback(token_, host, port);
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
  // Handshake slots (Note [TCPStore protocol], limits): an address holds a few; a new
  // connection of an address at its budget displaces that address's oldest handshake, and one
  // that finds the server full displaces the oldest handshake of all. Authenticated connections
  // are never displaced, so a stranger can cost a rank a retry, never its place.
  error_code ep_ec;
  const auto ep = socket.remote_endpoint(ep_ec);
  const std::string from = ep_ec ? std::string("unknown") : ep.address().to_string();
  if (auto it = handshakes_per_address_.find(from);
      it != handshakes_per_address_.end() && it->second >= max_handshakes_per_address_) {
    for (const auto& [number, conn] : handshakes_) {
      if (conn->address() != from) continue;
      displace(*conn, str("displaced by a newer connection from ", from, ", which holds its ",
                          max_handshakes_per_address_, " handshake slots ",
                          "(TDIST_STORE_MAX_HANDSHAKES_PER_ADDRESS)"));
      break;
    }
  }
  if (connections_.size() >= max_connections_ && !handshakes_.empty()) {
    displace(*handshakes_.begin()->second,
             str("displaced by a newer connection: the server holds its limit of ",
                 max_connections_, " connections (TDIST_STORE_MAX_CONNECTIONS)"));
  }
  if (connections_.size() >= max_connections_) {
    // Over the cap with every connection authenticated: closed at once (the peer sees end-of-file), logged once per refusal burst.
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
    net::set_dead_peer_timeout(socket.native_handle(), dead_peer_timeout_);  // Note [Vanished hosts]
    auto conn = std::make_shared<TCPStoreConnection>(*this, std::move(socket), next_accept_number_++);
    connections_.insert(conn);
    num_connections_.fetch_add(1);
    handshakes_.emplace(conn->accept_number(), conn.get());
    ++handshakes_per_address_[conn->address()];
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

void TCPStoreServerImpl::displace(TCPStoreConnection& conn, const std::string& why) {
  on_failed_handshake(conn.peer(), why);
  conn.close(/*rejected=*/true);
}

void TCPStoreServerImpl::on_handshake_over(TCPStoreConnection& conn) {
  if (handshakes_.erase(conn.accept_number()) == 0) return;
  auto it = handshakes_per_address_.find(conn.address());
  if (it != handshakes_per_address_.end() && --it->second == 0) handshakes_per_address_.erase(it);
}

std::string TCPStoreServerImpl::refusal_before_body(const tcp_store::Header& header) const {
  // What a write stores is at least its body less the length prefixes; it may replace an
  // entry no larger than the largest ever stored. Beyond that it cannot fit, whatever its key.
  const auto code = static_cast<Command>(header.code);
  if (code == Command::kSet || code == Command::kCompareSet) {
    const uint64_t prefixes = code == Command::kSet ? 16 : 24;
    const uint64_t replaced = code == Command::kSet ? largest_entry_bytes_ : 2 * largest_entry_bytes_;
    const uint64_t room = max_bytes_ - std::min(held_bytes_, max_bytes_);
    if (header.body_bytes > prefixes && header.body_bytes - prefixes > room + replaced) {
      return str("the store at ", address(), " holds ", held_bytes_, " bytes of keys and values; ",
                 "a '", tcp_store::command_name(header.code), "' of ", header.body_bytes,
                 " bytes would pass its limit of ", max_bytes_,
                 " (TDIST_STORE_MAX_BYTES) and is refused before its body is read");
    }
  }
  if (header.body_bytes > max_body_bytes_in_flight_) {
    return str("a '", tcp_store::command_name(header.code), "' of ", header.body_bytes,
               " bytes is larger than the store at ", address(), " takes in at once (",
               max_body_bytes_in_flight_, " bytes, TDIST_STORE_MAX_INFLIGHT_BYTES)");
  }
  return {};
}

bool TCPStoreServerImpl::reserve_body(const std::shared_ptr<TCPStoreConnection>& conn,
                                      uint64_t bytes) {
  // First come, first served: a large body is not overtaken for ever by small ones.
  if (waiting_for_budget_.empty() && body_bytes_in_flight_ + bytes <= max_body_bytes_in_flight_) {
    body_bytes_in_flight_ += bytes;
    if (body_bytes_in_flight_ > peak_body_bytes_.load()) peak_body_bytes_ = body_bytes_in_flight_;
    return true;
  }
  waiting_for_budget_.push_back(conn);
  return false;
}

void TCPStoreServerImpl::release_body(uint64_t bytes) {
  body_bytes_in_flight_ -= bytes;
  if (stopping_) return;
  while (!waiting_for_budget_.empty()) {
    auto next = waiting_for_budget_.front();
    if (next->closed()) {
      waiting_for_budget_.pop_front();
      continue;
    }
    if (body_bytes_in_flight_ + next->body_bytes() > max_body_bytes_in_flight_) break;
    waiting_for_budget_.pop_front();
    body_bytes_in_flight_ += next->body_bytes();
    if (body_bytes_in_flight_ > peak_body_bytes_.load()) peak_body_bytes_ = body_bytes_in_flight_;
    next->start_body();
  }
}

void TCPStoreServerImpl::on_connection_closed(TCPStoreConnection* conn) {
  unpark(*conn);
  on_handshake_over(*conn);
  waiting_for_budget_.erase(
      std::remove_if(waiting_for_budget_.begin(), waiting_for_budget_.end(),
                     [conn](const auto& c) { return c.get() == conn; }),
      waiting_for_budget_.end());
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

uint64_t TCPStoreServer::peak_body_bytes() const { return impl_->peak_body_bytes(); }

}  // namespace tdist
