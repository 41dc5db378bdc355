#include "tdist/rpc/detail/connection.h"

#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <ATen/ops/empty.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>

#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/net/address.h"
#include "tdist/core/process_memory.h"
#include "tdist/core/serialize.h"
#include "tdist/rpc/detail/tensor_pool.h"

namespace tdist::rpc::detail {
namespace {

constexpr size_t kReadBuffer = 256 << 10;
constexpr size_t kBodyChunk = 1 << 20;

// The connection whose reader this thread is (nullptr on other threads).
thread_local const Connection* tl_reader = nullptr;

}  // namespace

void set_socket_buffers(int fd, int bytes) {
  if (bytes <= 0) return;
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
}

Connection::Connection(int fd, bool outgoing, const ConnectionOptions& options,
                       ConnectionHandler* handler, Executor* executor)
    : fd_(fd),
      outgoing_(outgoing),
      options_(options),
      handler_(handler),
      executor_(executor),
      slots_(options.shm_bytes) {
  int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  net::set_dead_peer_timeout(fd_, net::dead_peer_timeout());  // Note [Vanished hosts]
  set_socket_buffers(fd_, options_.socket_buffer_bytes);
  // The read buffer comes once the peer is authenticated (run()): an unauthenticated
  // connection costs a thread and a socket, not 256 KiB.
  net::Address peer;
  peer.len = sizeof(peer.storage);
  peer_address_ = ::getpeername(fd_, peer.get(), &peer.len) == 0
                      ? net::host_port(peer.text(), peer.port())
                      : std::string("an unknown address");
}

std::string Connection::peer() const {
  const int rank = peer_rank();
  return rank >= 0 ? str("worker rank ", rank, " (", peer_address_, ")")
                   : str("unauthenticated peer ", peer_address_);
}

std::shared_ptr<Connection> Connection::outgoing(int fd, const HandshakeResult& hs,
                                                 const ConnectionOptions& options,
                                                 ConnectionHandler* handler, Executor* executor) {
  std::shared_ptr<Connection> c(new Connection(fd, true, options, handler, executor));
  c->hs_ = hs;
  c->peer_rank_ = hs.peer_rank;
  return c;
}

std::shared_ptr<Connection> Connection::incoming(int fd, const ConnectionOptions& options,
                                                 ConnectionHandler* handler, Executor* executor) {
  return std::shared_ptr<Connection>(new Connection(fd, false, options, handler, executor));
}

Connection::~Connection() {
  if (reader_.joinable()) {
    if (reader_.get_id() == std::this_thread::get_id()) {
      reader_.detach();
    } else {
      closing_ = true;
      {
        std::lock_guard<std::mutex> lock(flight_mu_);  // a reader waiting for room wakes
      }
      flight_cv_.notify_all();
      ::shutdown(fd_, SHUT_RDWR);
      reader_.join();
    }
  }
  ::close(fd_);
}

void Connection::start() {
  reader_ = std::thread([self = shared_from_this()] { self->run(); });
}

void Connection::join() {
  if (reader_.joinable() && reader_.get_id() != std::this_thread::get_id()) reader_.join();
}

bool Connection::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

std::string Connection::close_reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return close_reason_;
}

void Connection::close(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    close_reason_ = reason;
  }
  closing_ = true;
  {
    std::lock_guard<std::mutex> lock(flight_mu_);  // a reader waiting for room wakes
  }
  flight_cv_.notify_all();
  // shutdown() (not close()) wakes the reader blocked in recv and a writer blocked in sendmsg;
  // the descriptor is closed by the destructor once nobody uses it. A side sleeping on a
  // shared-memory ring does not see the socket: its futex is rung.
  ::shutdown(fd_, SHUT_RDWR);
  if (ShmStream* rx = rx_active_.load()) rx->wake_self();
  if (tx_state_.load() >= kOffered) tx_stream_->wake_self();
}

bool Connection::evict() {
  int in_handshake = kInHandshake;
  if (outgoing_ || !hs_state_.compare_exchange_strong(in_handshake, kEvicted)) return false;
  // Wakes the reader in its handshake read; it writes the busy marker and closes.
  ::shutdown(fd_, SHUT_RD);
  return true;
}

void Connection::run() {
  tl_reader = this;
  auto self = shared_from_this();
  std::string reason;
  try {
    if (!outgoing_) {
      try {
        hs_ = server_handshake(fd_, options_.handshake, [this] {
          int in_handshake = kInHandshake;
          return hs_state_.compare_exchange_strong(in_handshake, kHelloVerified);
        });
      } catch (const std::exception& e) {
        if (hs_state_.load() == kEvicted) {
          send_busy(fd_);
          throw NetworkError(str(peer(),
                                 ": closed before its handshake finished, to make room: "
                                 "more connections were in their handshake than "
                                 "RpcOptions::max_pending_handshakes "
                                 "(TDIST_RPC_MAX_PENDING_HANDSHAKES); told to retry"));
        }
        throw ProtocolError(str(peer(), ": ", e.what()));
      }
      peer_rank_ = hs_.peer_rank;
      const std::string refused = handler_->on_authenticated(self);
      if (!refused.empty()) throw ProtocolError(str(peer(), ": ", refused));
    }
    in_.resize(kReadBuffer);
    set_timeout(SO_SNDTIMEO, options_.send_timeout);
    // Bounds a read inside a frame; between frames the reader waits without limit (fill()).
    set_timeout(SO_RCVTIMEO, options_.frame_timeout);
    read_frames();
  } catch (const std::exception& e) {
    reason = e.what();
  }
  close(reason);
  handler_->on_closed(self, close_reason());  // the first reason: e.g. why close() was called
  finished_ = true;
}

void Connection::set_timeout(int option, Millis timeout) {
  if (timeout.count() <= 0) return;
  struct timeval tv {};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  ::setsockopt(fd_, SOL_SOCKET, option, &tv, sizeof(tv));
}

void Connection::throw_read_error(ssize_t n) {
  if (n == 0) throw NetworkError(str("connection closed by ", peer()));
  if (errno == EAGAIN || errno == EWOULDBLOCK) {
    throw TimeoutError(str(peer(), " sent part of a frame and then nothing for ",
                           options_.frame_timeout.count(),
                           " ms (the RPC timeout); closing the connection"));
  }
  throw NetworkError(str("reading from ", peer(), ": ", std::strerror(errno)));
}

size_t Connection::receive(void* dst, size_t n) {
  if (between_frames_ && options_.spin.count() > 0) {
    // The next frame often comes within microseconds (a reply to a small call): look for it
    // without sleeping for a while (Note [RPC waits spin first] in rpc/agent.cpp).
    const auto until = std::chrono::steady_clock::now() + options_.spin;
    for (;;) {
      ssize_t k = 0;
      if (ShmStream* rx = rx_active_.load(std::memory_order_relaxed)) {
        k = static_cast<ssize_t>(rx->read_some(dst, n));
      } else {
        k = ::recv(fd_, dst, n, MSG_DONTWAIT);
        if (k == 0 || (k < 0 && errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)) {
          throw_read_error(k);
        }
      }
      if (k > 0) {
        between_frames_ = false;
        return static_cast<size_t>(k);
      }
      if (std::chrono::steady_clock::now() >= until) break;
      std::this_thread::yield();
    }
  }
  if (rx_active_.load(std::memory_order_relaxed)) return receive_stream(dst, n);
  for (;;) {
    ssize_t k = ::recv(fd_, dst, n, 0);
    if (k > 0) {
      between_frames_ = false;
      return static_cast<size_t>(k);
    }
    if (k < 0 && errno == EINTR) continue;
    // SO_RCVTIMEO passed: fine while no byte of the next frame has come (an idle peer).
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && between_frames_) continue;
    throw_read_error(k);
  }
}

size_t Connection::receive_stream(void* dst, size_t n) {
  ShmStream* rx = rx_active_.load(std::memory_order_relaxed);
  // Between frames the reader waits without limit; inside one each wait is bounded (as
  // SO_RCVTIMEO bounds recv).
  const bool bounded = !between_frames_ && options_.frame_timeout.count() > 0;
  const auto deadline = std::chrono::steady_clock::now() + options_.frame_timeout;
  std::chrono::nanoseconds slice = kStreamLivenessSlice;
  for (;;) {
    size_t k = rx->read_some(dst, n);
    if (k == 0) k = check_socket_after_switch(dst, n);
    if (k > 0) {
      between_frames_ = false;
      return k;
    }
    std::chrono::nanoseconds wait = slice;
    // An idle connection looks at its socket less and less often (kStreamIdleSlice at most).
    slice = std::min<std::chrono::nanoseconds>(2 * slice, kStreamIdleSlice);
    if (bounded) {
      const auto left = deadline - std::chrono::steady_clock::now();
      if (left <= left.zero()) {
        errno = EAGAIN;
        throw_read_error(-1);
      }
      wait = std::min<std::chrono::nanoseconds>(wait, left);
    }
    rx->wait(wait.count());
  }
}

size_t Connection::check_socket_after_switch(void* dst, size_t n) {
  uint8_t byte = 0;
  const ssize_t r = ::recv(fd_, &byte, 1, MSG_DONTWAIT);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
  if (r > 0) {
    throw ProtocolError(str(peer(),
                            " wrote to its socket after it moved its frames to shared "
                            "memory"));
  }
  // End-of-file or an error: what the peer wrote into the ring before it went is still read.
  const int err = errno;
  if (size_t k = rx_active_.load(std::memory_order_relaxed)->read_some(dst, n)) return k;
  errno = err;
  throw_read_error(r);
}

size_t Connection::fill(size_t want) {
  return receive(in_.data() + in_end_, std::min(want, in_.size() - in_end_));
}

void Connection::read(void* dst, size_t size) {
  auto* d = static_cast<uint8_t*>(dst);
  size_t k = std::min(in_end_ - in_pos_, size);
  if (k) std::memcpy(d, in_.data() + in_pos_, k);
  in_pos_ += k;
  d += k;
  size -= k;
  if (size == 0) return;
  in_pos_ = in_end_ = 0;
  if (size >= in_.size() / 2) {
    // Large: straight into the destination, no staging copy.
    while (size > 0) {
      k = receive(d, size);
      d += k;
      size -= k;
    }
    return;
  }
  while (size > 0) {
    in_end_ += fill(in_.size() - in_end_);
    k = std::min(in_end_ - in_pos_, size);
    std::memcpy(d, in_.data() + in_pos_, k);
    in_pos_ += k;
    d += k;
    size -= k;
  }
}

void Connection::request_done() {
  if (in_flight_.fetch_sub(1) == options_.max_requests_in_flight) {
    std::lock_guard<std::mutex> lock(flight_mu_);
    flight_cv_.notify_all();
  }
}

void Connection::wait_for_room() {
  if (options_.max_requests_in_flight <= 0 || in_flight_.load() < options_.max_requests_in_flight) {
    return;
  }
  std::unique_lock<std::mutex> lock(flight_mu_);
  flight_cv_.wait(lock, [this] {
    return closing_.load() || in_flight_.load() < options_.max_requests_in_flight;
  });
  if (closing_.load()) throw NetworkError(str("connection to ", peer(), " is closing"));
}

void Connection::read_frames() {
  auto self = shared_from_this();
  uint8_t hdr[kHeaderSize];
  for (;;) {
    wait_for_room();  // backpressure: the peer's requests wait in TCP, not in our memory
    between_frames_ = in_pos_ == in_end_;
    read(hdr, sizeof(hdr));
    FrameHeader h = decode_header(hdr, options_.max_frame_bytes);
    received_frame_ = true;
    if (h.type == MessageType::kTensorRelease) {
      if (h.length != 0) throw ProtocolError("TENSOR_RELEASE frame with a body");
      release(h.id);
      continue;
    }
    if (h.type == MessageType::kShmRelease) {
      if (h.length != 0) throw ProtocolError("SHM_RELEASE frame with a body");
      slots_.release(h.id);
      continue;
    }
    if (is_stream_frame(h.type)) {
      Bytes body;
      if (h.length == h.body_len && h.body_len <= kMaxStreamOfferBytes) {
        body.resize(h.body_len);
        read(body.data(), body.size());
      }
      on_stream_frame(h, body);  // checks the frame's shape first
      continue;
    }
    Message m;
    m.type = h.type;
    m.flags = h.flags;
    m.id = h.id;
    m.from = peer_rank();
    // The body grows as its bytes arrive: a peer that announces a large frame and sends less
    // makes us allocate at most about twice what it sent.
    size_t got = 0;
    while (got < h.body_len) {
      size_t chunk = std::min<size_t>(h.body_len - got, std::max(got, kBodyChunk));
      m.body.resize(got + chunk);
      read(m.body.data() + got, chunk);
      got += chunk;
    }
    TensorSection section = take_tensor_section(h, m.body);
    read_frame_tensors(h, m, section);
    if (is_request(m.type)) in_flight_.fetch_add(1);
    handler_->on_message(self, std::move(m));
  }
}

void Connection::read_frame_tensors(const FrameHeader& h, Message& m, TensorSection& section) {
  check_tensor_section(h, section, hs_.read_remote_tensors, options_.max_frame_bytes);
  for (uint64_t tag : section.retired) mappings_.retire(tag);
  const bool any_remote = !section.addresses.empty();
  const pid_t pid = hs_.peer_pid;
  auto read_remote = [&](const TensorMeta& meta, uint64_t src) {
    at::Tensor t = empty_for_receive(meta);
    if (meta.nbytes) {
      auto* dst = static_cast<uint8_t*>(t.data_ptr());
      parallel_copy(meta.nbytes, [&](uint64_t off, uint64_t n) {
        read_process_memory(pid, src + off, dst + off, n);
      });
    }
    return t;
  };
  bool any_read = false;  // a tensor read from the sender's own memory: TENSOR_RELEASE
  m.tensors.reserve(section.metas.size());
  for (size_t i = 0; i < section.metas.size(); ++i) {
    const TensorMeta& meta = section.metas[i];
    if (any_remote && section.addresses[i] != 0) {
      const ShmRef* slot =
          !section.shm.empty() && section.shm[i].tag != 0 ? &section.shm[i] : nullptr;
      std::optional<at::Tensor> t;
      if (slot) t = mappings_.tensor(pid, *slot, meta, releases_);
      if (t) {
        m.tensors.push_back(std::move(*t));
        continue;
      }
      m.tensors.push_back(read_remote(meta, section.addresses[i]));
      if (slot) {
        releases_->push(slot->tag);  // read out of the slot: the sender may reuse it
      } else {
        any_read = true;
      }
    } else {
      // Its storage grows as its bytes arrive (rpc/detail/tensor_pool.h): the frame's length
      // was checked against the tensors' sizes, but it is only the peer's word.
      m.tensors.push_back(receive_tensor(meta, [this](void* dst, size_t n) { read(dst, n); }));
    }
  }
  // The sender holds those tensors until it hears that we are done with its memory.
  if (any_read) post_control(MessageType::kTensorRelease, h.id);
}

void Connection::post_control(MessageType type, uint64_t id) {
  std::weak_ptr<Connection> weak = weak_from_this();
  executor_->post([weak, type, id] {
    if (auto c = weak.lock()) {
      OutMessage m;
      m.type = type;
      m.id = id;
      try {
        c->send(std::move(m));
      } catch (const std::exception&) {
        // Closed: the peer dropped what the frame was about with the connection.
      }
    }
  });
}

void Connection::on_stream_frame(const FrameHeader& h, const Bytes& body) {
  const StreamOffer offer = check_stream_frame(h, body);
  if (h.type == MessageType::kStreamOffer) {
    if (!hs_.read_remote_tensors) {
      throw ProtocolError(str(peer(),
                              " offered a shared-memory stream without the same-host "
                              "fast path"));
    }
    if (rx_stream_) throw ProtocolError(str(peer(), " offered a second shared-memory stream"));
    std::string why;
    rx_stream_ = ShmStream::open(hs_.peer_pid, offer.fd, h.id, offer.capacity, &why);
    if (!rx_stream_) {
      TDIST_LOG_DEBUG("rpc: frames from ", peer(), " stay on TCP: ", why);
      return;
    }
    post_control(MessageType::kStreamAccept, h.id);
  } else if (h.type == MessageType::kStreamAccept) {
    int offered = kOffered;
    if (tx_state_.load() != kOffered || tx_stream_->tag() != h.id ||
        !tx_state_.compare_exchange_strong(offered, kAccepted)) {
      throw ProtocolError(str(peer(), " accepted a shared-memory stream it was not offered"));
    }
    tx_stream_->close_fd();  // the peer has mapped it; the writer no longer reads fd()
  } else {
    if (!rx_stream_ || rx_stream_->tag() != h.id || rx_active_.load()) {
      throw ProtocolError(str(peer(),
                              " switched to a shared-memory stream that was not "
                              "accepted"));
    }
    if (in_pos_ != in_end_) {
      throw ProtocolError(str(peer(),
                              " wrote to its socket after it moved its frames to shared "
                              "memory"));
    }
    rx_active_ = rx_stream_.get();
  }
}

void Connection::release(uint64_t id) {
  std::vector<at::Tensor> dropped;
  std::lock_guard<std::mutex> lock(retained_mu_);
  auto it = retained_.find(id);
  if (it == retained_.end()) return;  // idempotent
  dropped.swap(it->second);
  retained_.erase(it);
}

void Connection::frame(OutMessage& m) {
  TensorSection section;
  std::vector<at::Tensor> wire;
  std::vector<at::Tensor> remote;
  uint64_t inline_bytes = 0;
  // Slots filled for this frame go back to free if it throws before it is queued, and the
  // retired slots it was to name wait for the next frame.
  struct Unput {
    ShmSlots& slots;
    const std::vector<uint64_t>& retired;
    std::vector<uint64_t> tags;
    bool framed = false;
    ~Unput() {
      if (!framed) {
        for (uint64_t tag : tags) slots.release(tag);
        slots.untake_retired(retired);
      }
    }
  } unput{slots_, section.retired, {}};
  section.metas.reserve(m.tensors.size());
  for (auto& t : m.tensors) {
    at::Tensor c = contiguous_values(t);  // resolves conjugate / negative views
    TensorMeta meta = describe_tensor(c);
    const bool is_remote =
        hs_.send_remote_tensors && meta.nbytes >= options_.remote_tensor_threshold;
    std::optional<ShmSlots::Put> slot;
    if (is_remote && options_.shm_bytes > 0) {
      slot = slots_.put(c.data_ptr(), meta.nbytes);
    }
    section.shm.push_back(slot ? slot->ref : ShmRef{});
    if (slot) {
      section.addresses.push_back(slot->address);
      unput.tags.push_back(slot->ref.tag);
    } else if (is_remote) {
      section.addresses.push_back(reinterpret_cast<uint64_t>(c.data_ptr()));
      remote.push_back(std::move(c));
    } else {
      section.addresses.push_back(0);
      inline_bytes += meta.nbytes;
      if (meta.nbytes) wire.push_back(std::move(c));
    }
    section.metas.push_back(std::move(meta));
  }
  if (!section.metas.empty()) section.retired = slots_.take_retired(kMaxRetired);
  if (unput.tags.empty()) section.shm.clear();
  if (remote.empty() && unput.tags.empty() && section.retired.empty()) section.addresses.clear();
  const size_t payload = m.body.size();
  if (!section.metas.empty()) {
    BytesOutputArchive ar(m.body);
    ar(section);
  }
  const uint64_t body_len = m.body.size();
  TDIST_CHECK_ARG(body_len <= UINT32_MAX, "message body of ", body_len,
                  " bytes (without tensors) exceeds 4 GiB");
  FrameHeader h;
  h.type = m.type;
  h.flags = m.flags | (section.addresses.empty() ? 0 : kFlagRemoteTensors);
  h.body_len = static_cast<uint32_t>(body_len);
  h.meta_len = static_cast<uint32_t>(body_len - payload);
  h.id = m.id;
  h.length = body_len + inline_bytes;
  TDIST_CHECK_ARG(h.length <= options_.max_frame_bytes, "message of ", h.length,
                  " bytes exceeds the maximum frame size of ", options_.max_frame_bytes,
                  " bytes (RpcOptions::max_frame_bytes)");
  encode_header(h, m.header.data());
  unput.framed = true;
  m.tensor_bytes = inline_bytes;
  m.tensors = std::move(wire);
  if (!remote.empty()) {
    std::lock_guard<std::mutex> lock(retained_mu_);
    retained_[m.id] = std::move(remote);
  }
}

void Connection::send(OutMessage&& m) {
  // A reader that blocks in sendmsg stops reading: the responses behind it wait, and so does
  // every peer thread that writes to it. Whatever a reader must send is posted.
  TDIST_CHECK(tl_reader == nullptr,
              "send() on the reader thread of the connection to worker "
              "rank ",
              tl_reader ? tl_reader->peer_rank() : -1, " (post it to a worker thread)");
  frame(m);
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) {
    throw NetworkError(
        str("connection to worker rank ", peer_rank(), " is closed: ", close_reason_));
  }
  queue_.push_back(std::move(m));
  if (writing_) return;  // the writing thread picks it up
  writing_ = true;
  std::deque<OutMessage> batch;
  while (!queue_.empty()) {
    batch.swap(queue_);
    lock.unlock();
    try {
      add_slot_releases(batch);
      offer_stream(batch);
      write_batch(batch);
    } catch (const std::exception& e) {
      lock.lock();
      writing_ = false;
      queue_.clear();
      lock.unlock();
      close(e.what());
      throw;
    }
    batch.clear();
    lock.lock();
  }
  writing_ = false;
}

void Connection::add_slot_releases(std::deque<OutMessage>& batch) {
  for (uint64_t tag : releases_->take()) {
    OutMessage rel;
    rel.type = MessageType::kShmRelease;
    rel.id = tag;
    FrameHeader h;
    h.type = rel.type;
    h.id = tag;
    encode_header(h, rel.header.data());
    batch.push_back(std::move(rel));
  }
}

void Connection::offer_stream(std::deque<OutMessage>& batch) {
  if (tx_state_.load(std::memory_order_relaxed) != kNone) return;
  if (!hs_.send_remote_tensors || options_.stream_bytes == 0) {
    tx_state_ = kNever;
    return;
  }
  tx_stream_ = ShmStream::create(options_.stream_bytes);
  if (!tx_stream_) {
    TDIST_LOG_DEBUG("rpc: frames to ", peer(), " stay on TCP: no shared-memory stream of ",
                    options_.stream_bytes, " bytes: ", std::strerror(errno));
    tx_state_ = kNever;
    return;
  }
  OutMessage offer;
  offer.type = MessageType::kStreamOffer;
  offer.id = tx_stream_->tag();
  offer.body = encode(StreamOffer{tx_stream_->fd(), tx_stream_->capacity()});
  frame(offer);
  batch.push_front(std::move(offer));
  tx_state_ = kOffered;
}

void Connection::switch_to_stream() {
  FrameHeader h;
  h.type = MessageType::kStreamSwitch;
  h.id = tx_stream_->tag();
  std::array<uint8_t, kHeaderSize> header{};
  encode_header(h, header.data());
  std::vector<struct iovec> iov{{header.data(), header.size()}};
  write_socket(iov);
  tx_state_ = kStreaming;
}

void Connection::check_writable_socket() {
  if (closing_.load()) {
    throw NetworkError(
        str("connection to worker rank ", peer_rank(), " is closed: ", close_reason()));
  }
  struct pollfd p {
    fd_, POLLRDHUP, 0
  };
  if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
    throw NetworkError(str("sending to worker rank ", peer_rank(),
                           ": the peer closed the "
                           "connection"));
  }
}

void Connection::write_stream(const std::vector<struct iovec>& iov) {
  for (const auto& v : iov) {
    const auto* p = static_cast<const uint8_t*>(v.iov_base);
    size_t left = v.iov_len;
    // As SO_SNDTIMEO: the send timeout bounds each stall, not the whole write.
    std::optional<std::chrono::steady_clock::time_point> stalled_until;
    while (left > 0) {
      if (size_t k = tx_stream_->write_some(p, left)) {
        p += k;
        left -= k;
        stalled_until.reset();
        continue;
      }
      check_writable_socket();
      std::chrono::nanoseconds wait = kStreamLivenessSlice;
      if (options_.send_timeout.count() > 0) {
        const auto now = std::chrono::steady_clock::now();
        if (!stalled_until) stalled_until = now + options_.send_timeout;
        if (now >= *stalled_until) throw_send_timeout();
        wait = std::min<std::chrono::nanoseconds>(wait, *stalled_until - now);
      }
      tx_stream_->wait(wait.count());
    }
  }
}

void Connection::throw_send_timeout() const {
  throw TimeoutError(str("sending to worker rank ", peer_rank(), " timed out after ",
                         options_.send_timeout.count(), " ms (the worker stopped reading)"));
}

void Connection::write_batch(std::deque<OutMessage>& batch) {
  if (tx_state_.load(std::memory_order_relaxed) == kAccepted) switch_to_stream();
  std::vector<struct iovec> iov;
  iov.reserve(batch.size() * 3);
  for (auto& m : batch) {
    iov.push_back({m.header.data(), kHeaderSize});
    if (!m.body.empty()) iov.push_back({m.body.data(), m.body.size()});
    for (auto& t : m.tensors) iov.push_back({t.data_ptr(), t.nbytes()});
  }
  if (tx_state_.load(std::memory_order_relaxed) == kStreaming) {
    write_stream(iov);
  } else {
    write_socket(iov);
  }
}

void Connection::write_socket(std::vector<struct iovec>& iov) {
  size_t idx = 0;
  while (idx < iov.size()) {
    struct msghdr mh {};
    mh.msg_iov = &iov[idx];
    mh.msg_iovlen = std::min<size_t>(IOV_MAX, iov.size() - idx);
    ssize_t n = ::sendmsg(fd_, &mh, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) throw_send_timeout();
      throw NetworkError(str("sending to worker rank ", peer_rank(), ": ", std::strerror(errno)));
    }
    auto left = static_cast<size_t>(n);
    while (idx < iov.size() && left >= iov[idx].iov_len) {
      left -= iov[idx].iov_len;
      ++idx;
    }
    if (left) {
      iov[idx].iov_base = static_cast<uint8_t*>(iov[idx].iov_base) + left;
      iov[idx].iov_len -= left;
    }
  }
}

}  // namespace tdist::rpc::detail
