#include "tdist/comm/detail/p2p_engine.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/wire.h"

namespace tdist::comm::detail {
namespace {
constexpr uint32_t kMagic = 0x32504454;  // "TDP2"
constexpr size_t kHeader = 16;

template <typename E, typename... Args>
std::exception_ptr make_error(const Args&... args) {
  return std::make_exception_ptr(E(str(args...)));
}
}  // namespace

P2PEngine::P2PEngine(std::vector<tcp::Connection*> peers, int rank,
                     std::function<void(std::exception_ptr)> on_fatal)
    : peers_(std::move(peers)), rank_(rank), on_fatal_(std::move(on_fatal)) {
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  TDIST_CHECK(wake_fd_ >= 0, "eventfd failed: ", tcp::errno_text(errno));
  state_.resize(peers_.size());
  discard_buf_.resize(64 * 1024);
  thread_ = std::thread([this] { loop(); });
}

P2PEngine::~P2PEngine() {
  stop();
  ::close(wake_fd_);
}

void P2PEngine::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake();
  if (thread_.joinable()) thread_.join();
}

std::string P2PEngine::where(const Op& op) const {
  return str("rank ", rank_, ": ", op.is_send ? "send to" : "recv from",
             op.peer < 0 ? std::string(" any rank") : str(" rank ", op.peer), " (tag ", op.tag,
             ", p2p seq ", op.seq, ")");
}

void P2PEngine::wake() {
  uint64_t one = 1;
  ssize_t rc = ::write(wake_fd_, &one, sizeof(one));
  (void)rc;
}

void P2PEngine::send(const void* data, size_t bytes, int dst, uint32_t tag,
                     Clock::time_point deadline, uint64_t seq, Done done) {
  auto op = std::make_unique<Op>();
  op->data = static_cast<char*>(const_cast<void*>(data));
  op->bytes = bytes;
  op->peer = dst;
  op->tag = tag;
  op->deadline = deadline;
  op->seq = seq;
  op->done = std::move(done);
  op->is_send = true;
  Bytes h;
  wire::Writer w(h);
  w.u32(kMagic);
  w.u32(tag);
  w.u64(bytes);
  std::memcpy(op->header, h.data(), kHeader);
  post(std::move(op));
}

void P2PEngine::recv(void* data, size_t bytes, int src, uint32_t tag, Clock::time_point deadline,
                     uint64_t seq, Done done) {
  auto op = std::make_unique<Op>();
  op->data = static_cast<char*>(data);
  op->bytes = bytes;
  op->peer = src;
  op->tag = tag;
  op->deadline = deadline;
  op->seq = seq;
  op->done = std::move(done);
  op->is_send = false;
  post(std::move(op));
}

void P2PEngine::post(std::unique_ptr<Op> op) {
  std::exception_ptr aborted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborted = aborted_;
    if (!aborted) incoming_.push_back(std::move(op));
  }
  if (aborted) {
    complete(std::move(op), -1, aborted);
    return;
  }
  wake();
}

void P2PEngine::abort(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_) aborted_ = std::move(error);
  }
  wake();
}

void P2PEngine::complete(std::unique_ptr<Op> op, int source, std::exception_ptr error) {
  try {
    op->done(source, std::move(error));
  } catch (const std::exception& e) {
    TDIST_LOG_ERROR("rank ", rank_, ": a point-to-point completion callback threw: ", e.what());
  }
}

void P2PEngine::fatal(std::exception_ptr error) {
  abort(error);
  on_fatal_(error);
}

bool P2PEngine::progress_send(int peer) {
  auto& st = state_[peer];
  if (st.sends.empty() || st.closed) return false;
  Op& op = *st.sends.front();
  iovec iov[2];
  int count = 0;
  if (op.moved < kHeader) iov[count++] = iovec{op.header + op.moved, kHeader - op.moved};
  size_t payload_done = op.moved > kHeader ? op.moved - kHeader : 0;
  if (op.bytes > payload_done) iov[count++] = iovec{op.data + payload_done, op.bytes - payload_done};
  long n = peers_[peer]->writev(iov, count);
  if (n == tcp::Connection::kError) {
    int err = errno;
    auto e = make_error<NetworkError>(where(op), ": lost the connection after sending ", op.moved,
                                      " of ", op.bytes + kHeader, " bytes: ", tcp::errno_text(err));
    st.closed = true;
    if (op.moved == 0) {
      // Nothing of this message is on the wire: fail it (and the rest) without aborting.
      while (!st.sends.empty()) {
        auto o = std::move(st.sends.front());
        st.sends.pop_front();
        complete(std::move(o), peer, e);
      }
      return true;
    }
    fatal(e);
    return true;
  }
  if (n <= 0) return false;
  op.moved += static_cast<size_t>(n);
  if (op.moved == op.bytes + kHeader) {
    auto done = std::move(st.sends.front());
    st.sends.pop_front();
    complete(std::move(done), peer, nullptr);
  }
  return true;
}

bool P2PEngine::try_match(int peer) {
  auto& st = state_[peer];
  for (auto it = recvs_.begin(); it != recvs_.end(); ++it) {
    Op& op = **it;
    if ((op.peer != peer && op.peer != -1) || op.tag != st.tag) continue;
    auto matched = std::move(*it);
    recvs_.erase(it);
    if (matched->bytes != st.payload) {
      auto e = make_error<InvalidArgument>(where(*matched), ": rank ", peer, " sent ", st.payload,
                                           " bytes but the receive buffer holds ", matched->bytes,
                                           " bytes");
      complete(std::move(matched), peer, e);
      st.discard = st.payload;
      if (st.discard == 0) st.header_got = 0;
      return true;
    }
    if (st.payload == 0) {
      st.header_got = 0;
      complete(std::move(matched), peer, nullptr);
      return true;
    }
    st.reading = std::move(matched);
    return true;
  }
  return false;
}

bool P2PEngine::progress_read(int peer) {
  auto& st = state_[peer];
  if (st.closed) return false;
  iovec iov;
  if (st.header_got < kHeader) {
    iov = iovec{st.header + st.header_got, kHeader - st.header_got};
  } else if (st.reading) {
    iov = iovec{st.reading->data + st.reading->moved, st.reading->bytes - st.reading->moved};
  } else if (st.discard > 0) {
    iov = iovec{discard_buf_.data(), std::min<uint64_t>(st.discard, discard_buf_.size())};
  } else {
    return try_match(peer);  // a held header waits for a matching receive
  }
  long n = peers_[peer]->readv(&iov, 1);
  if (n == tcp::Connection::kClosed || n == tcp::Connection::kError) {
    int err = n == tcp::Connection::kError ? errno : 0;
    std::string cause = err ? tcp::errno_text(err) : std::string("the connection was closed");
    st.closed = true;
    if (st.header_got == 0) {
      // A clean end between messages: only receives that need this rank fail.
      for (auto it = recvs_.begin(); it != recvs_.end();) {
        if ((*it)->peer == peer) {
          auto op = std::move(*it);
          it = recvs_.erase(it);
          auto e = make_error<NetworkError>(where(*op), ": rank ", peer,
                                            " closed its connection (", cause, ")");
          complete(std::move(op), peer, e);
        } else {
          ++it;
        }
      }
      if (!st.sends.empty() && st.sends.front()->moved > 0) {
        fatal(make_error<NetworkError>("rank ", rank_, ": lost rank ", peer,
                                       " in the middle of a point-to-point message: ", cause));
        return true;
      }
      while (!st.sends.empty()) {
        auto op = std::move(st.sends.front());
        st.sends.pop_front();
        auto e = make_error<NetworkError>(where(*op), ": rank ", peer, " closed its connection (",
                                          cause, ")");
        complete(std::move(op), peer, e);
      }
      return true;
    }
    fatal(make_error<NetworkError>("rank ", rank_, ": lost rank ", peer,
                                   " in the middle of a point-to-point message: ", cause));
    return true;
  }
  if (n == 0) return false;
  if (st.header_got < kHeader) {
    st.header_got += static_cast<size_t>(n);
    if (st.header_got == kHeader) {
      wire::Reader r(st.header, kHeader);
      uint32_t magic = r.u32();
      st.tag = r.u32();
      st.payload = r.u64();
      if (magic != kMagic) {
        fatal(make_error<ProtocolError>("rank ", rank_, ": bad point-to-point header from rank ",
                                        peer, " (magic ", magic, ")"));
        return true;
      }
      try_match(peer);
    }
  } else if (st.reading) {
    st.reading->moved += static_cast<size_t>(n);
    if (st.reading->moved == st.reading->bytes) {
      st.header_got = 0;
      complete(std::move(st.reading), peer, nullptr);
    }
  } else {
    st.discard -= static_cast<uint64_t>(n);
    if (st.discard == 0) st.header_got = 0;
  }
  return true;
}

void P2PEngine::expire(Clock::time_point now) {
  auto timeout_error = [&](const Op& op, const char* what) {
    return make_error<TimeoutError>(where(op), " timed out: ", what);
  };
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    if ((*it)->deadline <= now) {
      auto op = std::move(*it);
      it = recvs_.erase(it);
      auto e = timeout_error(*op, "no matching message arrived");
      complete(std::move(op), -1, e);
    } else {
      ++it;
    }
  }
  for (size_t p = 0; p < state_.size(); ++p) {
    auto& st = state_[p];
    if (st.reading && st.reading->deadline <= now) {
      fatal(timeout_error(*st.reading, "the message stopped arriving midway"));
      return;
    }
    for (size_t i = 0; i < st.sends.size(); ++i) {
      if (st.sends[i]->deadline > now) continue;
      if (st.sends[i]->moved > 0) {
        fatal(timeout_error(*st.sends[i], "the receiver stopped reading midway"));
        return;
      }
      auto op = std::move(st.sends[i]);
      st.sends.erase(st.sends.begin() + static_cast<long>(i));
      --i;
      auto e = timeout_error(*op, "the receiver did not read it");
      complete(std::move(op), -1, e);
    }
  }
}

void P2PEngine::loop() {
  std::vector<pollfd> fds;
  for (;;) {
    std::vector<std::unique_ptr<Op>> posted;
    std::exception_ptr aborted;
    bool stop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      posted.swap(incoming_);
      aborted = aborted_;
      stop = stop_;
    }
    if (stop && !aborted) {
      aborted = make_error<Error>("rank ", rank_,
                                  ": the process group was destroyed with this operation pending");
    }
    for (auto& op : posted) {
      if (!aborted && op->peer >= 0 && state_[op->peer].closed) {
        const int peer = op->peer;
        auto e = make_error<NetworkError>(where(*op), ": the connection to rank ", peer,
                                          " is closed");
        complete(std::move(op), peer, e);
        continue;
      }
      if (op->is_send) {
        state_[op->peer].sends.push_back(std::move(op));
      } else {
        recvs_.push_back(std::move(op));
      }
    }
    if (aborted) {
      for (auto& op : recvs_) complete(std::move(op), -1, aborted);
      recvs_.clear();
      for (auto& st : state_) {
        for (auto& op : st.sends) complete(std::move(op), -1, aborted);
        st.sends.clear();
        if (st.reading) complete(std::move(st.reading), -1, aborted);
      }
      if (stop) return;
    }
    bool progressed = true;
    while (progressed) {
      progressed = false;
      for (int p = 0; p < static_cast<int>(peers_.size()); ++p) {
        if (p == rank_) continue;
        progressed |= progress_send(p);
        progressed |= progress_read(p);
      }
    }
    auto now = Clock::now();
    expire(now);
    Clock::time_point deadline = Clock::time_point::max();
    for (auto& op : recvs_) deadline = std::min(deadline, op->deadline);
    fds.clear();
    fds.push_back(pollfd{wake_fd_, POLLIN, 0});
    for (int p = 0; p < static_cast<int>(peers_.size()); ++p) {
      auto& st = state_[p];
      if (p == rank_ || st.closed) continue;
      short events = 0;
      if (!st.sends.empty()) {
        events |= POLLOUT;
        for (auto& op : st.sends) deadline = std::min(deadline, op->deadline);
      }
      if (st.header_got < kHeader || st.reading || st.discard > 0) events |= POLLIN;
      if (st.reading) deadline = std::min(deadline, st.reading->deadline);
      fds.push_back(pollfd{peers_[p]->fd(), events, 0});
    }
    int rc = ::poll(fds.data(), fds.size(), tcp::poll_timeout_ms(deadline));
    if (rc < 0 && errno != EINTR) {
      fatal(make_error<NetworkError>("rank ", rank_, ": poll failed: ", tcp::errno_text(errno)));
    }
    if (rc > 0 && (fds[0].revents & POLLIN)) {
      uint64_t v;
      ssize_t k = ::read(wake_fd_, &v, sizeof(v));
      (void)k;
    }
  }
}

}  // namespace tdist::comm::detail
