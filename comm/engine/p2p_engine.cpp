#include "tdist/comm/engine/p2p_engine.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/net/address.h"
#include "tdist/core/wire.h"

namespace tdist::comm::detail {
namespace {
constexpr uint32_t kMagic = 0x33504454;  // "TDP3"
constexpr size_t kHeader = 32;
constexpr int kMaxFrameIov = 32;

// The eager credit a message of `bytes` costs (Note [Point-to-point protocol]).
uint64_t eager_cost(uint64_t bytes) { return bytes + kHeader; }

// Frame kinds (Note [Point-to-point protocol]).
enum Kind : uint32_t { kEager = 1, kRts = 2, kCts = 3, kData = 4, kCredit = 5, kCancel = 6 };

void encode_header(uint8_t* out, uint32_t kind, uint32_t tag, uint64_t bytes, uint64_t id) {
  Bytes h;
  wire::Writer w(h);
  w.u32(kMagic);
  w.u32(kind);
  w.u32(tag);
  w.u32(0);
  w.u64(bytes);
  w.u64(id);
  std::memcpy(out, h.data(), kHeader);
}

template <typename E, typename... Args>
std::exception_ptr make_error(const Args&... args) {
  return std::make_exception_ptr(E(str(args...)));
}
}  // namespace

P2PEngine::P2PEngine(std::vector<tcp::Connection*> peers, int rank,
                     std::function<void(std::exception_ptr)> on_fatal)
    : peers_(std::move(peers)), rank_(rank), on_fatal_(std::move(on_fatal)) {
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  TDIST_CHECK(wake_fd_ >= 0, "eventfd failed: ", net::errno_text(errno));
  state_.resize(peers_.size());
  for (auto& st : state_) st.credit = kEagerCredit;
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
  post(std::unique_ptr<Op>(new Op{static_cast<char*>(const_cast<void*>(data)), bytes, dst, tag,
                                  deadline, seq, std::move(done), true}));
}

void P2PEngine::recv(void* data, size_t bytes, int src, uint32_t tag, Clock::time_point deadline,
                     uint64_t seq, Done done) {
  post(std::unique_ptr<Op>(
      new Op{static_cast<char*>(data), bytes, src, tag, deadline, seq, std::move(done), false}));
}

void P2PEngine::send(std::shared_ptr<Payload> payload, size_t bytes, int dst, uint32_t tag,
                     Clock::time_point deadline, uint64_t seq, Done done) {
  post(std::unique_ptr<Op>(
      new Op{nullptr, bytes, dst, tag, deadline, seq, std::move(done), true, std::move(payload)}));
}

void P2PEngine::recv(std::shared_ptr<Payload> payload, size_t bytes, int src, uint32_t tag,
                     Clock::time_point deadline, uint64_t seq, Done done) {
  post(std::unique_ptr<Op>(
      new Op{nullptr, bytes, src, tag, deadline, seq, std::move(done), false, std::move(payload)}));
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
  if (!op) return;
  try {
    op->done(source, std::move(error));
  } catch (const std::exception& e) {
    TDIST_LOG_ERROR("rank ", rank_, ": a point-to-point completion callback threw: ", e.what());
  }
}

void P2PEngine::fatal(std::exception_ptr error) {
  failed_ = true;
  abort(error);
  on_fatal_(error);
}

void P2PEngine::fail_all(std::exception_ptr error) {
  for (auto& op : recvs_) complete(std::move(op), -1, error);
  recvs_.clear();
  unexpected_.clear();
  for (auto& st : state_) {
    st.announced = 0;
    for (auto& op : st.held) complete(std::move(op), -1, error);
    st.held.clear();
    for (auto& f : st.out) complete(std::move(f.op), -1, error);
    st.out.clear();
    for (auto& [id, op] : st.awaiting_cts) complete(std::move(op), -1, error);
    st.awaiting_cts.clear();
    for (auto& [id, op] : st.bound) complete(std::move(op), -1, error);
    st.bound.clear();
    complete(std::move(st.reading), -1, error);
    st.stash.reset();
  }
}

// ---- sending -------------------------------------------------------------------------------

void P2PEngine::queue_control(int peer, uint32_t kind, uint32_t tag, uint64_t bytes, uint64_t id) {
  auto& st = state_[peer];
  if (st.closed) return;
  OutFrame f;
  encode_header(f.header, kind, tag, bytes, id);
  st.out.push_back(std::move(f));
}

// An eager message of `bytes` from `peer` was consumed: its cost goes back to the peer.
void P2PEngine::return_credit(int peer, uint64_t bytes) {
  auto& st = state_[peer];
  const uint64_t cost = eager_cost(bytes);
  st.eager_held -= std::min(st.eager_held, cost);
  queue_control(peer, kCredit, 0, cost, 0);
}

void P2PEngine::start_send(std::unique_ptr<Op> op) {
  const int peer = op->peer;
  auto& st = state_[peer];
  if (st.closed) {
    auto e = make_error<NetworkError>(where(*op), ": the connection to rank ", peer, " is closed");
    complete(std::move(op), peer, e);
    return;
  }
  // Behind a held send, a send waits too: messages of one tag match in the order they were sent.
  if (!st.held.empty() || !try_send(peer, op)) st.held.push_back(std::move(op));
}

// Queues `op` (taking it) as EAGER or RTS; false, leaving `op`, when the peer already holds
// kMaxAnnounced of this rank's announcements.
bool P2PEngine::try_send(int peer, std::unique_ptr<Op>& op) {
  auto& st = state_[peer];
  if (!op->payload && op->bytes <= kEagerMax && eager_cost(op->bytes) <= st.credit) {
    st.credit -= eager_cost(op->bytes);
    OutFrame f;
    encode_header(f.header, kEager, op->tag, op->bytes, 0);
    f.data = op->data;
    f.bytes = op->bytes;
    f.eager = true;
    f.op = std::move(op);
    st.out.push_back(std::move(f));
    return true;
  }
  if (st.awaiting_cts.size() >= kMaxAnnounced) return false;
  const uint64_t id = st.next_id++;
  queue_control(peer, kRts, op->tag, op->bytes, id);
  st.awaiting_cts.emplace(id, std::move(op));
  return true;
}

// Sends the held sends that now fit, in order.
void P2PEngine::release_held(int peer) {
  auto& st = state_[peer];
  while (!st.held.empty() && !st.closed && try_send(peer, st.held.front())) st.held.pop_front();
}

bool P2PEngine::progress_send(int peer) {
  auto& st = state_[peer];
  st.stalled = false;
  if (st.out.empty() || st.closed || !st.write_failed.empty()) return false;
  iovec iov[kMaxFrameIov];
  int count = 0;
  for (size_t i = 0; i < st.out.size() && count + 2 <= kMaxFrameIov; ++i) {
    OutFrame& f = st.out[i];
    if (f.moved < kHeader) iov[count++] = iovec{f.header + f.moved, kHeader - f.moved};
    size_t done = f.moved > kHeader ? f.moved - kHeader : 0;
    if (f.bytes <= done) continue;
    if (f.payload == nullptr) {
      iov[count++] = iovec{const_cast<char*>(f.data) + done, f.bytes - done};
      continue;
    }
    char* at = nullptr;
    const size_t ready = std::min<size_t>(f.payload->span(done, &at), f.bytes - done);
    if (ready > 0) iov[count++] = iovec{at, ready};
    if (done + ready < f.bytes) {
      st.stalled = count == 0;  // nothing to write until more of the payload is ready
      break;                    // what follows this frame waits for the rest of it
    }
  }
  if (count == 0) return false;
  long n = peers_[peer]->writev(iov, count);
  if (n == tcp::Connection::kError) {
    st.write_failed = net::errno_text(errno);  // read what is left first (Note [Losing a peer])
    return true;
  }
  if (n <= 0) return false;
  size_t left = static_cast<size_t>(n);
  while (left > 0) {
    OutFrame& f = st.out.front();
    size_t take = std::min<size_t>(left, kHeader + f.bytes - f.moved);
    f.moved += take;
    left -= take;
    if (f.payload != nullptr && f.moved > kHeader) f.payload->moved(f.moved - kHeader);
    if (f.moved < kHeader + f.bytes) break;
    auto op = std::move(f.op);
    st.out.pop_front();
    complete(std::move(op), peer, nullptr);
  }
  return true;
}

// ---- receiving -----------------------------------------------------------------------------

void P2PEngine::start_recv(std::unique_ptr<Op> op) {
  for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
    if ((op->peer != -1 && op->peer != it->peer) || op->tag != it->tag) continue;
    Unexpected u = std::move(*it);
    unexpected_.erase(it);
    if (!u.eager) --state_[u.peer].announced;
    deliver(u.peer, std::move(op), u.eager, u.bytes, u.id, &u.data);
    return;
  }
  if (op->peer >= 0 && state_[op->peer].closed) {
    const int peer = op->peer;
    auto e = make_error<NetworkError>(where(*op), ": the connection to rank ", peer, " is closed");
    complete(std::move(op), peer, e);
    return;
  }
  recvs_.push_back(std::move(op));
}

// `op` takes the message `id` (RTS) or the eager payload in `data` from `peer`.
void P2PEngine::deliver(int peer, std::unique_ptr<Op> op, bool eager, uint64_t bytes, uint64_t id,
                        std::vector<char>* data) {
  std::exception_ptr error;
  if (op->bytes != bytes) {
    error =
        make_error<InvalidArgument>(where(*op), ": rank ", peer, " sent ", bytes,
                                    " bytes but the receive buffer holds ", op->bytes, " bytes");
  }
  if (eager) {
    // A streamed receive is larger than any eager message: the sizes differ.
    TDIST_CHECK(error || !op->payload, where(*op), ": an eager message for a streamed receive");
    if (!error && bytes > 0) std::memcpy(op->data, data->data(), bytes);
    return_credit(peer, bytes);
    complete(std::move(op), peer, error);
    return;
  }
  // Ask for the payload; on a size mismatch it is dropped when it comes (the sender succeeds).
  queue_control(peer, kCts, op->tag, bytes, id);
  if (error) {
    complete(std::move(op), peer, error);
    state_[peer].bound.emplace(id, nullptr);
  } else {
    state_[peer].bound.emplace(id, std::move(op));
  }
}

// The first posted receive that takes a message of `tag` from `peer`, removed from recvs_.
std::unique_ptr<P2PEngine::Op> P2PEngine::take_posted(int peer, uint32_t tag) {
  for (auto it = recvs_.begin(); it != recvs_.end(); ++it) {
    if (((*it)->peer == peer || (*it)->peer == -1) && (*it)->tag == tag) {
      auto op = std::move(*it);
      recvs_.erase(it);
      return op;
    }
  }
  return nullptr;
}

void P2PEngine::on_header(int peer) {
  auto& st = state_[peer];
  wire::Reader r(st.header, kHeader);
  const uint32_t magic = r.u32();
  st.kind = r.u32();
  st.tag = r.u32();
  r.u32();
  st.bytes = r.u64();
  st.id = r.u64();
  st.payload_got = 0;
  st.target = nullptr;
  if (magic != kMagic) {
    fatal(make_error<ProtocolError>("rank ", rank_, ": bad point-to-point header from rank ", peer,
                                    " (magic ", magic, ")"));
    return;
  }
  switch (st.kind) {
    case kEager: {
      if (st.bytes > kEagerMax) {
        fatal(make_error<ProtocolError>("rank ", rank_, ": rank ", peer,
                                        " sent an eager message of ", st.bytes, " bytes (at most ",
                                        kEagerMax, " are allowed)"));
        return;
      }
      if (st.eager_held + eager_cost(st.bytes) > kEagerCredit) {
        broke_protocol(
            peer, str("it sent an eager message of ", st.bytes, " bytes beyond its eager credit (",
                      st.eager_held, " of ", kEagerCredit, " bytes in use)"));
        return;
      }
      st.eager_held += eager_cost(st.bytes);
      if (auto op = take_posted(peer, st.tag)) {
        if (op->bytes != st.bytes || op->payload) {
          // Dropped as it arrives; the credit goes back once it has been read. (A streamed
          // receive is larger than any eager message: its sizes always differ.)
          deliver_mismatch(peer, std::move(op));
        } else {
          st.target = op->data;
          st.reading = std::move(op);
        }
      } else {
        st.stash = std::make_unique<std::vector<char>>(st.bytes);
        st.target = st.stash->data();
      }
      if (st.bytes == 0) on_payload_done(peer);
      return;
    }
    case kData: {
      auto it = st.bound.find(st.id);
      if (it == st.bound.end()) {
        fatal(make_error<ProtocolError>("rank ", rank_, ": rank ", peer,
                                        " sent the payload of message ", st.id,
                                        ", which was not asked for"));
        return;
      }
      auto op = std::move(it->second);
      st.bound.erase(it);
      if (op && op->bytes != st.bytes) {
        fatal(make_error<ProtocolError>(where(*op), ": rank ", peer, " sent ", st.bytes,
                                        " bytes after announcing ", op->bytes));
        return;
      }
      if (op) {
        st.target = op->data;
        st.reading = std::move(op);
      }
      if (st.bytes == 0) on_payload_done(peer);
      return;
    }
    case kRts:
      st.header_got = 0;
      if (auto op = take_posted(peer, st.tag)) {
        deliver(peer, std::move(op), false, st.bytes, st.id, nullptr);
      } else if (st.announced >= kMaxAnnounced) {
        broke_protocol(peer, str("it announced more than ", kMaxAnnounced,
                                 " messages that no receive has taken"));
      } else {
        ++st.announced;
        unexpected_.push_back(Unexpected{peer, st.tag, st.bytes, st.id, false, {}});
      }
      return;
    case kCts: {
      st.header_got = 0;
      auto it = st.awaiting_cts.find(st.id);
      if (it == st.awaiting_cts.end()) return;  // cancelled meanwhile (CANCEL is on its way)
      OutFrame f;
      encode_header(f.header, kData, it->second->tag, it->second->bytes, st.id);
      f.data = it->second->data;
      f.payload = it->second->payload.get();
      f.bytes = it->second->bytes;
      f.id = st.id;
      f.op = std::move(it->second);
      st.awaiting_cts.erase(it);
      st.out.push_back(std::move(f));
      release_held(peer);
      return;
    }
    case kCredit:
      st.header_got = 0;
      // More than was spent is the peer's mistake; it never raises the credit above the start.
      st.credit = kEagerCredit - std::min(kEagerCredit - st.credit, st.bytes);
      release_held(peer);
      return;
    case kCancel: {
      st.header_got = 0;
      for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
        if (it->peer == peer && !it->eager && it->id == st.id) {
          unexpected_.erase(it);
          --st.announced;
          return;
        }
      }
      auto it = st.bound.find(st.id);
      if (it == st.bound.end()) return;
      auto op = std::move(it->second);
      st.bound.erase(it);
      if (op) {
        auto e = make_error<TimeoutError>(where(*op), " failed: rank ", peer,
                                          " gave up sending the message (its send timed out)");
        complete(std::move(op), peer, e);
      }
      return;
    }
    default:
      fatal(make_error<ProtocolError>("rank ", rank_, ": unknown point-to-point frame kind ",
                                      st.kind, " from rank ", peer));
  }
}

void P2PEngine::deliver_mismatch(int peer, std::unique_ptr<Op> op) {
  auto e = make_error<InvalidArgument>(where(*op), ": rank ", peer, " sent ", state_[peer].bytes,
                                       " bytes but the receive buffer holds ", op->bytes, " bytes");
  complete(std::move(op), peer, e);
}

void P2PEngine::on_payload_done(int peer) {
  auto& st = state_[peer];
  st.header_got = 0;
  st.target = nullptr;
  if (st.kind == kData) {
    complete(std::move(st.reading), peer, nullptr);
    return;
  }
  // EAGER: into a posted receive, into the stash (unexpected), or dropped (size mismatch).
  if (st.reading) {
    return_credit(peer, st.bytes);
    complete(std::move(st.reading), peer, nullptr);
  } else if (st.stash) {
    std::vector<char> data = std::move(*st.stash);
    st.stash.reset();
    // A matching receive may have been posted while the payload arrived.
    if (auto op = take_posted(peer, st.tag)) {
      deliver(peer, std::move(op), true, st.bytes, 0, &data);
    } else {
      unexpected_.push_back(Unexpected{peer, st.tag, st.bytes, 0, true, std::move(data)});
    }
  } else {
    return_credit(peer, st.bytes);
  }
}

bool P2PEngine::progress_read(int peer) {
  auto& st = state_[peer];
  if (st.closed) return false;
  iovec iov;
  Payload* payload = st.header_got == kHeader && st.reading ? st.reading->payload.get() : nullptr;
  if (st.header_got < kHeader) {
    iov = iovec{st.header + st.header_got, kHeader - st.header_got};
  } else if (payload != nullptr) {
    char* at = nullptr;
    const size_t room =
        std::min<uint64_t>(payload->span(st.payload_got, &at), st.bytes - st.payload_got);
    TDIST_CHECK(room > 0, where(*st.reading), ": no room for byte ", st.payload_got);
    iov = iovec{at, room};
  } else if (st.target != nullptr) {
    iov = iovec{st.target + st.payload_got, st.bytes - st.payload_got};
  } else {
    iov = iovec{discard_buf_.data(),
                std::min<uint64_t>(st.bytes - st.payload_got, discard_buf_.size())};
  }
  long n = peers_[peer]->readv(&iov, 1);
  if (n == tcp::Connection::kClosed || n == tcp::Connection::kError) {
    std::string cause = n == tcp::Connection::kError ? net::errno_text(errno)
                                                     : std::string("the connection was closed");
    if (!st.write_failed.empty()) cause = str(st.write_failed, " writing, then ", cause);
    lost_peer(peer, cause);
    return true;
  }
  if (n == 0) return false;
  if (st.header_got < kHeader) {
    st.header_got += static_cast<size_t>(n);
    if (st.header_got == kHeader) on_header(peer);
  } else {
    st.payload_got += static_cast<uint64_t>(n);
    if (payload != nullptr) payload->moved(st.payload_got);
    if (st.payload_got == st.bytes) on_payload_done(peer);
  }
  return true;
}

// The connection to `peer` failed or was closed. Between frames only the operations that need
// this peer fail; in the middle of a frame the stream is lost and the group aborts.
void P2PEngine::lost_peer(int peer, const std::string& cause) {
  auto& st = state_[peer];
  st.closed = true;
  const bool midway = st.header_got > 0 || (!st.out.empty() && st.out.front().moved > 0);
  if (midway) {
    fatal(make_error<NetworkError>("rank ", rank_, ": lost rank ", peer,
                                   " in the middle of a point-to-point message: ", cause));
    return;
  }
  // Announced messages can no longer be fetched; whole eager ones stay deliverable.
  unexpected_.remove_if([&](const Unexpected& u) { return u.peer == peer && !u.eager; });
  close_pair(peer, [&](const Op& op) {
    return make_error<NetworkError>(where(op), ": rank ", peer, " closed its connection (", cause,
                                    ")");
  });
}

// `peer` exceeded a limit of Note [Point-to-point protocol]: its connection is shut down and
// what needs it fails; the rest of the group goes on (the stream to it is abandoned, so a frame
// midway does not matter).
void P2PEngine::broke_protocol(int peer, const std::string& what) {
  auto& st = state_[peer];
  const std::string cause = str("rank ", peer, " broke the point-to-point protocol: ", what);
  TDIST_LOG_ERROR("rank ", rank_, ": ", cause, "; closing the connection to it");
  st.closed = true;
  st.header_got = 0;
  st.target = nullptr;
  st.stash.reset();
  peers_[peer]->shutdown();
  unexpected_.remove_if([&](const Unexpected& u) { return u.peer == peer; });
  close_pair(peer, [&](const Op& op) {
    return make_error<ProtocolError>(where(op), ": ", cause, " (its connection is closed)");
  });
}

// Fails every operation bound to `peer` with error(op); its announcements are gone.
void P2PEngine::close_pair(int peer, const std::function<std::exception_ptr(const Op&)>& error) {
  auto& st = state_[peer];
  st.announced = 0;
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    if ((*it)->peer == peer) {
      auto op = std::move(*it);
      it = recvs_.erase(it);
      auto e = error(*op);
      complete(std::move(op), peer, e);
    } else {
      ++it;
    }
  }
  auto fail = [&](std::unique_ptr<Op>& op) {
    if (!op) return;
    auto e = error(*op);
    complete(std::move(op), peer, e);
  };
  fail(st.reading);
  for (auto& [id, op] : st.bound) fail(op);
  st.bound.clear();
  for (auto& [id, op] : st.awaiting_cts) fail(op);
  st.awaiting_cts.clear();
  for (auto& op : st.held) fail(op);
  st.held.clear();
  for (auto& f : st.out) fail(f.op);
  st.out.clear();
}

// ---- deadlines -----------------------------------------------------------------------------

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
  for (int p = 0; p < static_cast<int>(state_.size()); ++p) {
    auto& st = state_[p];
    if (st.reading && st.reading->deadline <= now) {
      fatal(timeout_error(*st.reading, "the message stopped arriving midway"));
      return;
    }
    // Asked for, not arrived: the payload is dropped when it comes.
    for (auto& [id, op] : st.bound) {
      if (!op || op->deadline > now) continue;
      auto e = timeout_error(*op, "the sender did not send the message it announced");
      complete(std::move(op), p, e);
    }
    for (auto it = st.awaiting_cts.begin(); it != st.awaiting_cts.end();) {
      if (it->second->deadline > now) {
        ++it;
        continue;
      }
      auto op = std::move(it->second);
      queue_control(p, kCancel, op->tag, 0, it->first);
      it = st.awaiting_cts.erase(it);
      auto e = timeout_error(*op, "no matching receive was posted");
      complete(std::move(op), p, e);
    }
    for (auto it = st.held.begin(); it != st.held.end();) {
      if ((*it)->deadline > now) {
        ++it;
        continue;
      }
      auto op = std::move(*it);
      it = st.held.erase(it);
      auto e = timeout_error(*op, "the receiver did not take the messages sent before it");
      complete(std::move(op), p, e);
    }
    release_held(p);
    for (size_t i = 0; i < st.out.size(); ++i) {
      OutFrame& f = st.out[i];
      if (!f.op || f.op->deadline > now) continue;
      if (f.moved > 0) {
        fatal(timeout_error(*f.op, i == 0 && st.stalled
                                       ? "the copy of its tensor to host memory did not arrive"
                                       : "the receiver stopped reading midway"));
        return;
      }
      auto op = std::move(f.op);
      if (f.eager) {
        st.credit += eager_cost(f.bytes);
      } else {
        queue_control(p, kCancel, op->tag, 0, f.id);  // the receiver waits for this DATA
      }
      st.out.erase(st.out.begin() + static_cast<long>(i));
      --i;
      auto e = timeout_error(*op, "the receiver did not read it");
      complete(std::move(op), p, e);
    }
  }
}

P2PEngine::Clock::time_point P2PEngine::next_deadline() const {
  Clock::time_point d = Clock::time_point::max();
  for (const auto& op : recvs_) d = std::min(d, op->deadline);
  for (const auto& st : state_) {
    if (st.reading) d = std::min(d, st.reading->deadline);
    for (const auto& [id, op] : st.bound) {
      if (op) d = std::min(d, op->deadline);
    }
    for (const auto& [id, op] : st.awaiting_cts) d = std::min(d, op->deadline);
    for (const auto& op : st.held) d = std::min(d, op->deadline);
    for (const auto& f : st.out) {
      if (f.op) d = std::min(d, f.op->deadline);
    }
  }
  return d;
}

// ---- the engine thread ---------------------------------------------------------------------

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
    if (aborted) {
      // No more I/O: fail everything, then only wait to be stopped.
      for (auto& op : posted) complete(std::move(op), -1, aborted);
      fail_all(aborted);
      if (stop) return;
      pollfd wake{wake_fd_, POLLIN, 0};
      if (::poll(&wake, 1, -1) > 0) {
        uint64_t v;
        ssize_t k = ::read(wake_fd_, &v, sizeof(v));
        (void)k;
      }
      continue;
    }
    for (auto& op : posted) {
      if (op->is_send) {
        start_send(std::move(op));
      } else {
        start_recv(std::move(op));
      }
    }
    bool progressed = true;
    while (progressed && !failed_) {
      progressed = false;
      for (int p = 0; p < static_cast<int>(peers_.size()) && !failed_; ++p) {
        if (p == rank_) continue;
        progressed |= progress_send(p);
        if (!failed_) progressed |= progress_read(p);
      }
    }
    if (failed_) continue;
    expire(Clock::now());
    if (failed_) continue;
    fds.clear();
    fds.push_back(pollfd{wake_fd_, POLLIN, 0});
    bool stalled = false;
    for (int p = 0; p < static_cast<int>(peers_.size()); ++p) {
      auto& st = state_[p];
      if (p == rank_ || st.closed) continue;
      short events = POLLIN;  // every connection is always read (Note [Point-to-point protocol])
      if (!st.out.empty() && !st.stalled && st.write_failed.empty()) events |= POLLOUT;
      stalled |= st.stalled;
      fds.push_back(pollfd{peers_[p]->fd(), events, 0});
    }
    int rc;
    if (stalled) {  // a payload's next bytes: no descriptor signals them (Note [Streamed payloads])
      ::timespec brief{0, kStalledWaitNs};
      rc = ::ppoll(fds.data(), fds.size(), &brief, nullptr);
    } else {
      rc = ::poll(fds.data(), fds.size(), net::poll_ms(next_deadline()));
    }
    if (rc < 0 && errno != EINTR) {
      fatal(make_error<NetworkError>("rank ", rank_, ": poll failed: ", net::errno_text(errno)));
    }
    if (rc > 0 && (fds[0].revents & POLLIN)) {
      uint64_t v;
      ssize_t k = ::read(wake_fd_, &v, sizeof(v));
      (void)k;
    }
  }
}

}  // namespace tdist::comm::detail
