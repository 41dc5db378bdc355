// The TCPStore server: accepting and bounding connections, the body budget, the server's life
// (the contract is in tcp_store_server.h), and the resolution of its limits.

#include <sys/resource.h>

#include <algorithm>
#include <mutex>
#include <utility>

#include "tdist/core/detail/tcp_store_server.h"

#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/tcp_store.h"
#include "tdist/core/token.h"

namespace tdist {
namespace detail {

// ---- TCPStoreServerImpl -------------------------------------------------------------------------

namespace {

// Connections the server keeps open at most by default: 3/4 of the process's descriptor limit
// (the rest stays for the process itself), at least 64.
int64_t default_connection_limit() {
  rlimit rl{};
  int64_t fallback = 1024;
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    fallback = static_cast<int64_t>(rl.rlim_cur);
  }
  return std::clamp<int64_t>(fallback * 3 / 4, 64, int64_t(1) << 20);
}

// A set field, checked against [min, max] (InvalidArgument naming it), else the variable (whose
// value env::get_int checks, naming it), else the default.
int64_t resolve_int(const std::optional<int64_t>& set, const char* field, const char* variable,
                    int64_t fallback, int64_t min, int64_t max) {
  if (!set) return env::get_int(variable, fallback, min, max);
  TDIST_CHECK_ARG(*set >= min && *set <= max, "TCPStoreServerOptions::", field, " must be in [",
                  min, ", ", max, "], got ", *set);
  return *set;
}

std::optional<int64_t> count_of(const std::optional<Millis>& t) {
  return t ? std::optional<int64_t>(t->count()) : std::nullopt;
}

}  // namespace

StoreServerLimits resolve_server_limits(const TCPStoreServerOptions& o) {
  StoreServerLimits l;
  l.max_connections = static_cast<size_t>(
      resolve_int(o.max_connections, "max_connections", "TDIST_STORE_MAX_CONNECTIONS",
                  default_connection_limit(), 1, int64_t(1) << 20));
  l.max_keys =
      static_cast<size_t>(resolve_int(o.max_keys, "max_keys", "TDIST_STORE_MAX_KEYS",
                                      static_cast<int64_t>(l.max_keys), 1, int64_t(1) << 40));
  l.max_bytes =
      static_cast<uint64_t>(resolve_int(o.max_bytes, "max_bytes", "TDIST_STORE_MAX_BYTES",
                                        static_cast<int64_t>(l.max_bytes), 1, int64_t(1) << 50));
  l.frame_timeout =
      Millis(resolve_int(count_of(o.frame_timeout), "frame_timeout", "TDIST_STORE_FRAME_TIMEOUT_MS",
                         l.frame_timeout.count(), 1, int64_t(1) << 40));
  l.handshake_timeout = Millis(resolve_int(count_of(o.handshake_timeout), "handshake_timeout",
                                           "TDIST_STORE_HANDSHAKE_TIMEOUT_MS",
                                           l.handshake_timeout.count(), 1, int64_t(1) << 40));
  l.max_handshakes_per_address = static_cast<size_t>(
      resolve_int(o.max_handshakes_per_address, "max_handshakes_per_address",
                  "TDIST_STORE_MAX_HANDSHAKES_PER_ADDRESS",
                  static_cast<int64_t>(l.max_handshakes_per_address), 1, int64_t(1) << 20));
  l.max_inflight_bytes = static_cast<uint64_t>(
      resolve_int(o.max_inflight_bytes, "max_inflight_bytes", "TDIST_STORE_MAX_INFLIGHT_BYTES",
                  static_cast<int64_t>(l.max_inflight_bytes), 1, int64_t(1) << 50));
  l.allow_no_token =
      o.allow_no_token ? *o.allow_no_token : env::get_bool("TDIST_ALLOW_NO_TOKEN", false);
  return l;
}

TCPStoreServerImpl::TCPStoreServerImpl(const std::string& host, uint16_t port, std::string token,
                                       const StoreServerLimits& limits)
    : host_(host),
      token_(std::move(token)),
      acceptor_(io_),
      accept_retry_timer_(io_),
      max_connections_(limits.max_connections),
      frame_timeout_(limits.frame_timeout),
      handshake_timeout_(limits.handshake_timeout),
      max_handshakes_per_address_(limits.max_handshakes_per_address),
      max_body_bytes_in_flight_(limits.max_inflight_bytes),
      dead_peer_timeout_(net::dead_peer_timeout()),
      discard_buffer_(kBodyChunkBytes) {
  // Note [Secure by default] (core/token.h).
  require_token_beyond_loopback("the TCPStore server", !token_.empty(), host,
                                "TCPStoreOptions::token", limits.allow_no_token);
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
  table_ = std::make_unique<StoreTable>(io_, address(), limits.max_keys, limits.max_bytes);
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
  acceptor_.async_accept(
      [this](const error_code& ec, tcp::socket socket) { on_accept(ec, std::move(socket)); });
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
    net::set_dead_peer_timeout(socket.native_handle(),
                               dead_peer_timeout_);  // Note [Vanished hosts]
    auto conn =
        std::make_shared<TCPStoreConnection>(*this, std::move(socket), next_accept_number_++);
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
    TDIST_LOG_WARN("TCPStore server ", address(), ": refused the connection from ", peer, ": ", why,
                   " (", n, " refused handshakes so far)");
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
  if (std::string why = table_->write_refusal(header); !why.empty()) return why;
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
  table_->unpark(*conn);
  on_handshake_over(*conn);
  waiting_for_budget_.erase(std::remove_if(waiting_for_budget_.begin(), waiting_for_budget_.end(),
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
  table_->handle(conn, code, body);
}

}  // namespace detail

// ---- TCPStoreServer -----------------------------------------------------------------------------

TCPStoreServer::TCPStoreServer(const std::string& host, uint16_t port,
                               const std::optional<std::string>& token)
    : TCPStoreServer(host, port, [&] {
        TCPStoreServerOptions o;
        o.token = token;
        return o;
      }()) {}

TCPStoreServer::TCPStoreServer(const std::string& host, uint16_t port,
                               const TCPStoreServerOptions& options)
    : impl_(std::make_unique<detail::TCPStoreServerImpl>(
          host, port, resolve_token(options.token, "the TCPStoreServer's token").value,
          detail::resolve_server_limits(options))) {}

TCPStoreServer::~TCPStoreServer() = default;

uint16_t TCPStoreServer::port() const { return impl_->port(); }

const std::string& TCPStoreServer::host() const { return impl_->host(); }

int TCPStoreServer::num_connections() const { return impl_->num_connections(); }

int64_t TCPStoreServer::num_rejected_frames() const { return impl_->num_rejected_frames(); }

int64_t TCPStoreServer::num_refused_connections() const { return impl_->num_refused_connections(); }

int64_t TCPStoreServer::num_failed_handshakes() const { return impl_->num_failed_handshakes(); }

uint64_t TCPStoreServer::peak_body_bytes() const { return impl_->peak_body_bytes(); }

}  // namespace tdist
