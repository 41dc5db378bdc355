#include "tdist/comm/engine/exchange.h"

#include <poll.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "tdist/core/error.h"
#include "tdist/core/net/address.h"

namespace tdist::comm::detail {
namespace {
constexpr int kMaxIov = 64;
constexpr size_t kBounceBytes = 256 * 1024;
constexpr int kMaxSpinSkip = 63;
// How long a wait sleeps while a transfer is held by arrivals (Exchange::wait_for_io).
constexpr long kHeldWaitNs = 20000;

// A hint to the core that this is a spin-wait loop (it saves power and, with hyper-threads, lets
// the sibling run).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}
}  // namespace

Exchange::Exchange(std::vector<Channel*> peers, int rank, const std::atomic<bool>* aborted)
    : peers_(std::move(peers)), rank_(rank), aborted_(aborted) {
  sends_.resize(peers_.size());
  recvs_.resize(peers_.size());
  iov_.resize(kMaxIov);
  bounce_.resize(kBounceBytes);
  pollfds_.reserve(peers_.size());
}

std::string Exchange::where() const { return str("rank ", rank_, ": ", op_, " (seq ", seq_, ")"); }

void Exchange::begin(const char* op, uint64_t seq, Clock::time_point now,
                     Clock::time_point deadline) {
  op_ = op;
  seq_ = seq;
  deadline_ = deadline;
  started_ = now;
  bounce_left_ = 0;
  counts_ = Counts{};
  in_callback_ = false;  // a callback that threw left it set
  for (auto* qs : {&sends_, &recvs_}) {
    for (auto& q : *qs) {
      q.items.clear();
      q.head = 0;
      q.posted = q.moved = 0;
    }
  }
}

void Exchange::send(int peer, const void* data, size_t n, Gate gate) {
  if (n == 0) return;
  auto& q = sends_[peer];
  q.items.emplace_back(static_cast<char*>(const_cast<void*>(data)), n, 0, gate);
  q.posted += n;
  ++counts_.sends;
  if (in_callback_) ++counts_.forwards;
  counts_.bytes_sent += n;
}

void Exchange::recv(int peer, void* data, size_t n, uint64_t cookie) {
  auto& q = recvs_[peer];
  // A zero-byte receive still completes (in stream order) so that its callback runs.
  q.items.emplace_back(static_cast<char*>(data), n, cookie);
  q.posted += n;
  counts_.bytes_received += n;
}

void Exchange::swap_with_all(const void* mine, void* theirs, size_t n, Gate gate) {
  for (int p = 0; p < size(); ++p) {
    if (p == rank_) continue;
    send(p, mine, n, gate);
    recv(p, static_cast<char*>(theirs) + static_cast<size_t>(p) * n, n);
  }
  run();
}

void Exchange::recv_reduce(int peer, void* out, const void* other, size_t n, ReduceFn fn,
                           size_t elem, uint64_t cookie, Gate gate) {
  auto& q = recvs_[peer];
  Item it(static_cast<char*>(out), n, cookie, gate);
  it.other = static_cast<const char*>(other);
  it.fn = fn;
  it.elem = elem;
  q.items.push_back(it);
  q.posted += n;
  counts_.bytes_received += n;
}

void Exchange::check_aborted() const {
  if (aborted_ != nullptr && aborted_->load(std::memory_order_relaxed)) {
    TDIST_THROW(Error, where(), ": the process group was aborted");
  }
}

bool Exchange::open(Item& it) {
  Gate& g = it.gate;
  if (g.peer >= 0 && sends_[g.peer].moved < g.sent) return false;
  if (g.arrivals != nullptr) {
    if (!g.arrivals->arrived(g.piece)) return false;
    g.arrivals = nullptr;
  }
  return true;
}

bool Exchange::send_ready(int peer) {
  auto& q = sends_[peer];
  return q.pending() && open(q.items[q.head]);
}

bool Exchange::recv_ready(int peer) {
  auto& q = recvs_[peer];
  return q.pending() && open(q.items[q.head]);
}

const Exchange::Item* Exchange::held_by_arrivals() {
  for (auto* qs : {&sends_, &recvs_}) {
    for (auto& q : *qs) {
      if (!q.pending()) continue;
      Item& it = q.items[q.head];
      if (it.gate.arrivals != nullptr && !open(it)) return &it;
    }
  }
  return nullptr;
}

bool Exchange::progress_send(int peer) {
  auto& q = sends_[peer];
  if (!send_ready(peer)) return false;
  int count = 0;
  for (size_t i = q.head; i < q.items.size() && count < kMaxIov; ++i, ++count) {
    if (i > q.head && !open(q.items[i])) break;
    iov_[count].iov_base = q.items[i].data + q.items[i].done;
    iov_[count].iov_len = q.items[i].size - q.items[i].done;
  }
  long n = peers_[peer]->writev(iov_.data(), count);
  if (n == Channel::kError) fail_closed(peer, "sending to", errno);
  if (n <= 0) return false;
  q.moved += static_cast<uint64_t>(n);
  size_t left = static_cast<size_t>(n);
  while (left > 0) {
    Item& it = q.items[q.head];
    size_t take = std::min(left, it.size - it.done);
    it.done += take;
    left -= take;
    if (it.done == it.size) ++q.head;
  }
  return true;
}

bool Exchange::progress_recv(int peer, Callback cb, void* ctx) {
  auto& q = recvs_[peer];
  if (!recv_ready(peer)) return false;
  if (q.items[q.head].fn != nullptr) return progress_reduce(peer, cb, ctx);
  // A skipped item (skip(): no memory, bytes to drop) is read on its own too.
  const auto skipped = [](const Item& it) { return it.data == nullptr && it.done < it.size; };
  if (skipped(q.items[q.head])) return progress_skip(peer, cb, ctx);
  int count = 0;
  for (size_t i = q.head; i < q.items.size() && count < kMaxIov; ++i) {
    if (q.items[i].fn != nullptr || skipped(q.items[i])) break;  // each read on its own
    if (i > q.head && !open(q.items[i])) break;
    size_t left = q.items[i].size - q.items[i].done;
    if (left == 0) {
      if (count == 0) break;  // a zero-byte item at the head completes below
      continue;
    }
    iov_[count].iov_base = q.items[i].data + q.items[i].done;
    iov_[count].iov_len = left;
    ++count;
  }
  long n = 0;
  if (count > 0) {
    n = peers_[peer]->readv(iov_.data(), count);
    if (n == Channel::kClosed) fail_closed(peer, "receiving from", 0);
    if (n == Channel::kError) fail_closed(peer, "receiving from", errno);
  }
  q.moved += static_cast<uint64_t>(std::max(n, 0L));
  size_t left = static_cast<size_t>(std::max(n, 0L));
  bool progressed = n > 0;
  // Complete items in order; the callback may append to q.items (so index, never hold refs).
  while (q.head < q.items.size()) {
    Item& it = q.items[q.head];
    if (it.fn != nullptr || !open(it)) break;
    size_t take = std::min(left, it.size - it.done);
    it.done += take;
    left -= take;
    if (it.done < it.size) break;
    progressed = true;
    complete_head(q, peer, cb, ctx);
  }
  return progressed;
}

// `q`'s head item has all its bytes: the next one becomes the head, and the callback runs for it
// (it may append to q.items: callers index them again afterwards).
void Exchange::complete_head(Queue& q, int peer, Callback cb, void* ctx) {
  const uint64_t cookie = q.items[q.head].cookie;
  ++q.head;
  if (cb == nullptr) return;
  in_callback_ = true;
  cb(ctx, peer, cookie);
  in_callback_ = false;
}

// The head item, skipped: consumed unread where the channel shows its bytes in place (shared
// memory: the lines the peer wrote stay in its cache), else read into a small local buffer and
// dropped (never bounce_, which may hold a partial element of another peer's reduction).
bool Exchange::progress_skip(int peer, Callback cb, void* ctx) {
  auto& q = recvs_[peer];
  Item& it = q.items[q.head];
  Channel* ch = peers_[peer];
  const size_t left = it.size - it.done;
  long n = 0;
  if (ch->supports_peek()) {
    iovec spans[2];
    n = ch->peek(spans);
    if (n > 0) {
      n = static_cast<long>(std::min(static_cast<size_t>(n), left));
      ch->consume(static_cast<size_t>(n));
    }
  } else {
    char dropped[256];
    iovec iov{dropped, std::min(left, sizeof(dropped))};
    n = ch->readv(&iov, 1);
  }
  if (n == Channel::kClosed) fail_closed(peer, "receiving from", 0);
  if (n == Channel::kError) fail_closed(peer, "receiving from", errno);
  if (n <= 0) return false;
  q.moved += static_cast<uint64_t>(n);
  it.done += static_cast<size_t>(n);
  if (it.done == it.size) complete_head(q, peer, cb, ctx);
  return true;
}

// it.fn over `count` elements whose incoming operand is at `src`. The kernels may use aligned
// vector loads, so an operand that is not element-aligned in the ring (the stream carried an odd
// number of bytes before) is first copied to the aligned bounce buffer.
void Exchange::apply(Item& it, char* out, const char* other, const char* src, size_t count) {
  const size_t e = it.elem;
  if (reinterpret_cast<uintptr_t>(src) % e == 0) {
    it.fn(out, other, src, count);
    return;
  }
  const size_t per = bounce_.size() / e;
  for (size_t done = 0; done < count; done += per) {
    size_t m = std::min(per, count - done);
    std::memcpy(bounce_.data(), src + done * e, m * e);
    it.fn(out + done * e, other + done * e, bounce_.data(), m);
  }
}

// Reduces straight out of the channel's readable spans (whole elements only; an element split
// by the ring's wrap goes through a small copy).
size_t Exchange::reduce_spans(Item& it, const iovec spans[2], size_t budget) {
  const size_t e = it.elem;
  char* out = it.data + it.done;
  const char* other = it.other + it.done;
  const char* s0 = static_cast<const char*>(spans[0].iov_base);
  const char* s1 = static_cast<const char*>(spans[1].iov_base);
  const size_t len0 = spans[0].iov_len;
  const size_t len1 = spans[1].iov_len;
  size_t k0 = std::min(len0, budget) / e * e;
  if (k0 > 0) apply(it, out, other, s0, k0 / e);
  size_t used = k0;
  size_t off1 = 0;
  if (k0 == len0) {
    off1 = 0;
  } else if (len0 - k0 < e && budget - used >= e && len1 >= e - (len0 - k0)) {
    size_t a = len0 - k0;
    alignas(16) char tmp[32];
    std::memcpy(tmp, s0 + k0, a);
    std::memcpy(tmp + a, s1, e - a);
    it.fn(out + used, other + used, tmp, 1);
    used += e;
    off1 = e - a;
  } else {
    return used;  // budget-limited, or waiting for the rest of an element
  }
  size_t k1 = std::min(len1 - off1, budget - used) / e * e;
  if (k1 > 0) apply(it, out + used, other + used, s1 + off1, k1 / e);
  return used + k1;
}

// TCP: reads into the bounce buffer, reduces the whole elements, keeps a partial one. Returns
// the bytes reduced; `read` tells whether any byte arrived.
size_t Exchange::reduce_bounce(int peer, Item& it, bool& read) {
  const size_t e = it.elem;
  size_t want = std::min(it.size - it.done, bounce_.size()) - bounce_left_;
  iovec iov{bounce_.data() + bounce_left_, want};
  long n = peers_[peer]->readv(&iov, 1);
  if (n == Channel::kClosed) fail_closed(peer, "receiving from", 0);
  if (n == Channel::kError) fail_closed(peer, "receiving from", errno);
  read = n > 0;
  if (n <= 0) return 0;
  recvs_[peer].moved += static_cast<uint64_t>(n);
  size_t total = bounce_left_ + static_cast<size_t>(n);
  size_t k = total / e * e;
  if (k > 0) it.fn(it.data + it.done, it.other + it.done, bounce_.data(), k / e);
  bounce_left_ = total - k;
  if (bounce_left_ > 0) std::memmove(bounce_.data(), bounce_.data() + k, bounce_left_);
  return k;
}

bool Exchange::progress_reduce(int peer, Callback cb, void* ctx) {
  auto& q = recvs_[peer];
  Channel* ch = peers_[peer];
  bool progressed = false;
  while (q.head < q.items.size() && q.items[q.head].fn != nullptr && recv_ready(peer)) {
    Item& it = q.items[q.head];
    if (ch->supports_peek()) {
      iovec spans[2];
      long avail = ch->peek(spans);
      if (avail == Channel::kClosed) fail_closed(peer, "receiving from", 0);
      if (avail == Channel::kError) fail_closed(peer, "receiving from", errno);
      if (avail <= 0) break;
      size_t used =
          reduce_spans(it, spans, std::min(static_cast<size_t>(avail), it.size - it.done));
      if (used == 0) break;
      ch->consume(used);
      q.moved += used;
      it.done += used;
    } else {
      bool read = false;
      it.done += reduce_bounce(peer, it, read);
      if (!read) break;
    }
    progressed = true;
    if (it.done < it.size) continue;
    complete_head(q, peer, cb, ctx);
  }
  return progressed;
}

void Exchange::run_impl(Callback cb, void* ctx) {
  check_aborted();
  ++counts_.runs;
  const int n = size();
  Clock::time_point spin_until{};
  Clock::time_point busy_until{};
  bool spinning = false;
  bool busy = false;  // this spin's tries pause instead of yielding (until busy_until)
  for (;;) {
    bool pending = false;
    bool progressed = false;
    for (int p = 0; p < n; ++p) {
      if (p == rank_) continue;
      if (sends_[p].pending()) {
        progressed |= progress_send(p);
        pending |= sends_[p].pending();
      }
      if (recvs_[p].pending()) {
        progressed |= progress_recv(p, cb, ctx);
        // The callback may have posted sends to any peer.
        pending |= recvs_[p].pending();
      }
    }
    if (!pending) {
      // Callbacks can post to peers that were already visited in this pass.
      bool any = false;
      for (int p = 0; p < n && !any; ++p) any = sends_[p].pending() || recvs_[p].pending();
      if (!any) return;
      continue;
    }
    if (progressed) {
      if (spinning) spin_backoff_ = 0;  // the spin paid off
      if (busy) busy_backoff_ = 0;      // and within the busy poll
      spinning = busy = false;
      continue;
    }
    if (spin_us_ > 0 && spin_skip_ == 0) {
      auto now = Clock::now();
      if (!spinning) {
        spinning = true;
        spin_until = now + std::chrono::microseconds(spin_us_);
        busy_until = now + std::chrono::nanoseconds(busy_poll_ns_);
        busy = busy_poll_ns_ > 0 && busy_skip_ == 0;
        if (busy_skip_ > 0) --busy_skip_;
      }
      if (now < spin_until && now < deadline_) {
        check_aborted();
        if (busy && now >= busy_until) {
          // No answer within the busy poll: yield from here on, and busy-poll fewer of the next
          // spins (one in 2, 4, ... 64), so that a peer that needs this core gets it.
          busy = false;
          busy_backoff_ = std::min(2 * busy_backoff_ + 1, kMaxSpinSkip);
          busy_skip_ = busy_backoff_;
        }
        if (busy) {
          cpu_relax();
        } else {
          ::sched_yield();
        }
        continue;
      }
      // The peers answer slower than a spin lasts (large transfers, or a busy host): skip the
      // spin of the next waits, twice as many each time it runs out again.
      spin_backoff_ = std::min(2 * spin_backoff_ + 1, kMaxSpinSkip);
      spin_skip_ = spin_backoff_;
      ++counts_.spins_run_out;
    } else if (spin_skip_ > 0) {
      --spin_skip_;
    }
    spinning = busy = false;
    ++counts_.sleeps;
    wait_for_io();
  }
}

void Exchange::wait_for_io() {
  check_aborted();
  pollfds_.clear();
  poll_peers_.clear();
  // A transfer held by arrivals waits for a copy that no descriptor signals: sleep briefly
  // instead of until the next I/O (a piece's copy takes microseconds).
  const bool held = held_by_arrivals() != nullptr;
  int waiting = 0, only = -1;
  for (int p = 0; p < size(); ++p) {
    if (p == rank_ || !(send_ready(p) || recv_ready(p))) continue;
    ++waiting;
    only = p;
  }
  if (!held && waiting == 1 && wait_alone_ && peers_[only]->can_wait_alone()) {
    // One peer to wait for (world 2, or a ring whose send has left): its own sleep, no poll.
    if (!peers_[only]->wait_alone(recv_ready(only), send_ready(only), deadline_)) {
      fail_timeout();
    }
    return;
  }
  for (int p = 0; p < size(); ++p) {
    if (p == rank_) continue;
    bool want_write = send_ready(p);
    bool want_read = recv_ready(p);  // a gated receive waits for its gate, not the socket
    if (!want_write && !want_read) continue;
    ::pollfd pfd{};
    if (!peers_[p]->prepare_wait(want_read, want_write, pfd)) {
      // Progress became possible meanwhile; undo the other channels' registrations.
      for (int q : poll_peers_) peers_[q]->after_wait(0);
      return;
    }
    pollfds_.push_back(pfd);
    poll_peers_.push_back(p);
  }
  for (;;) {
    int rc;
    if (held) {
      ::timespec brief{0, kHeldWaitNs};
      rc = ::ppoll(pollfds_.data(), pollfds_.size(), &brief, nullptr);
    } else {
      rc = ::poll(pollfds_.data(), pollfds_.size(), net::poll_ms(deadline_));
    }
    if (rc > 0 || (rc == 0 && held && Clock::now() < deadline_)) break;
    if (rc < 0 && errno != EINTR) {
      TDIST_THROW(NetworkError, where(), ": poll failed: ", net::errno_text(errno));
    }
    if (rc == 0 && Clock::now() >= deadline_) {
      for (size_t i = 0; i < poll_peers_.size(); ++i) peers_[poll_peers_[i]]->after_wait(0);
      fail_timeout();
    }
  }
  for (size_t i = 0; i < poll_peers_.size(); ++i) {
    peers_[poll_peers_[i]]->after_wait(pollfds_[i].revents);
  }
}

void Exchange::fail_closed(int peer, const char* direction, int err) {
  check_aborted();
  const auto& s = sends_[peer];
  const auto& r = recvs_[peer];
  std::string cause = err == 0 ? std::string("the connection was closed (rank ") +
                                     std::to_string(peer) + " exited, crashed or aborted)"
                      : err == EPROTO
                          ? "it published an impossible counter in the shared-memory ring (" +
                                net::errno_text(err) + ")"
                          : net::errno_text(err);
  TDIST_THROW(NetworkError, where(), ": lost rank ", peer, " while ", direction, " it: ", cause,
              "; received ", r.moved, " of the ", r.posted, " bytes posted so far from it, sent ",
              s.moved, " of ", s.posted, " to it");
}

void Exchange::fail_timeout() {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started_).count();
  std::string waiting;
  for (int p = 0; p < size(); ++p) {
    if (p == rank_) continue;
    const auto& s = sends_[p];
    const auto& r = recvs_[p];
    if (!s.pending() && !r.pending()) continue;
    waiting +=
        str(waiting.empty() ? "" : "; ", "rank ", p, " (received ", r.moved, " of the ", r.posted,
            " bytes posted so far from it, sent ", s.moved, " of ", s.posted, " to it)");
  }
  if (const Item* it = held_by_arrivals()) {
    waiting += str(waiting.empty() ? "" : "; ",
                   "the copy of this rank's buffer to host memory (piece ", it->gate.piece, ")");
  }
  TDIST_THROW(TimeoutError, where(), ": Timed out after ", ms, " ms waiting for ", waiting);
}

}  // namespace tdist::comm::detail
