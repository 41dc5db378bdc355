// One accepted connection of the TCPStore server: the handshake, the frames, the replies
// (the contract is in tcp_store_connection.h).

#include "tdist/core/detail/tcp_store_connection.h"

#include <algorithm>
#include <utility>

#include "tdist/core/detail/store_util.h"
#include "tdist/core/detail/tcp_store_server.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"

namespace tdist::detail {

void TCPStoreConnection::start() {
  // The handshake must be over within the handshake timeout (short: it costs a client two round
  // trips, and a stranger that stalls holds one of its address's few slots meanwhile).
  handshake_.emplace(server_.token(), net::Service::kStore);
  arm_frame_deadline(server_.handshake_timeout());
  asio::async_write(
      socket_, asio::buffer(handshake_->challenge()),
      [self = shared_from_this()](const error_code& ec, size_t) { self->on_challenge_sent(ec); });
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
  asio::async_read(
      socket_, asio::buffer(hello_),
      [self = shared_from_this()](const error_code& ec, size_t n) { self->on_hello(ec, n); });
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
      asio::buffer(header_bytes_.data() + header_received_,
                   header_bytes_.size() - header_received_),
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
          self->peer_,
          str("the handshake was not over within ", seconds_text(self->server_.handshake_timeout()),
              " s (TDIST_STORE_HANDSHAKE_TIMEOUT_MS)"));
      self->close(/*rejected=*/true);
      return;
    }
    const bool in_header = self->header_received_ < self->header_bytes_.size();
    self->reject(str("the peer stalled inside a frame for ",
                     seconds_text(self->server_.frame_timeout()),
                     " s (TDIST_STORE_FRAME_TIMEOUT_MS), ",
                     in_header ? str("after ", self->header_received_, " of ",
                                     self->header_bytes_.size(), " header bytes")
                               : str("in the ", self->header_.body_bytes, "-byte body of '",
                                     tcp_store::command_name(self->header_.code), "'")));
  });
}

void TCPStoreConnection::arm_frame_deadline() { arm_frame_deadline(server_.frame_timeout()); }

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
    problem =
        str("request '", tcp_store::command_name(header_.code), "' arrived while '",
            tcp_store::command_name(static_cast<uint16_t>(waiter_->cmd)), "' is still pending");
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
  const size_t chunk =
      static_cast<size_t>(std::min<uint64_t>(header_.body_bytes - body_received_, sink.size()));
  asio::async_read(
      socket_, asio::buffer(sink.data(), chunk),
      [self = shared_from_this()](const error_code& ec, size_t n) { self->on_skipped(ec, n); });
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
  const size_t chunk =
      static_cast<size_t>(std::min<uint64_t>(header_.body_bytes - body_received_, kBodyChunkBytes));
  // Reserving at once keeps a large body from being copied over and over as the buffer doubles.
  if (body_received_ > 0 && body_.capacity() < header_.body_bytes) {
    body_.reserve(static_cast<size_t>(header_.body_bytes));
  }
  body_.resize(body_received_ + chunk);
  asio::async_read(
      socket_, asio::buffer(body_.data() + body_received_, chunk),
      [self = shared_from_this()](const error_code& ec, size_t n) { self->on_body_chunk(ec, n); });
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
  asio::async_write(
      socket_, asio::buffer(out_.front()),
      [self = shared_from_this()](const error_code& ec, size_t n) { self->on_write(ec, n); });
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
  TDIST_LOG_ERROR("TCPStore server ", server_.address(), ": closing the connection from ", peer_,
                  ": ", why);
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

}  // namespace tdist::detail
