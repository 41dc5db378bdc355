#include "tdist/rpc/detail/shm_stream.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "tdist/core/byte_ring.h"
#include "tdist/core/error.h"
#include "tdist/core/futex.h"
#include "tdist/rpc/bounds.h"
#include "tdist/rpc/detail/shm_tensors.h"

namespace tdist::rpc::detail {
namespace {

constexpr char kStreamMemfdName[] = "tdist-rpc-stream";

// Makes the sleeper on `bell` look again.
void ring_bell(std::atomic<uint32_t>& bell) {
  bell.fetch_add(1, std::memory_order_release);
  futex::wake(bell);
}

// Publishes our counter and wakes the other side when it sleeps (its waiting flag is set): the
// fence pairs with the one in ShmStream::wait, so one of the two sides always sees the other.
void publish(std::atomic<uint64_t>& counter, uint64_t value, std::atomic<uint32_t>& waiting,
             std::atomic<uint32_t>& bell) {
  counter.store(value, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (waiting.load(std::memory_order_relaxed) != 0) ring_bell(bell);
}

}  // namespace

static_assert(sizeof(ShmStream::Shared) <= kStreamDataOffset);

ShmStream::ShmStream(bool writer, void* base, size_t length, int fd, uint64_t tag,
                     uint64_t capacity)
    : writer_(writer),
      base_(base),
      length_(length),
      fd_(fd),
      tag_(tag),
      capacity_(capacity),
      shared_(static_cast<Shared*>(base)),
      data_(static_cast<uint8_t*>(base) + kStreamDataOffset) {}

ShmStream::~ShmStream() {
  ::munmap(base_, length_);
  close_fd();
}

void ShmStream::close_fd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::unique_ptr<ShmStream> ShmStream::create(uint64_t capacity) {
  std::optional<SealedMemfd> m =
      create_sealed_memfd(kStreamMemfdName, kStreamDataOffset + capacity);
  if (!m) return nullptr;
  // A fresh memfd reads as zeros: counters, flags and bells start at 0.
  auto* s = reinterpret_cast<Shared*>(m->base);
  s->magic = kStreamMagic;
  s->tag = new_shm_tag();
  s->capacity = capacity;
  return std::unique_ptr<ShmStream>(
      new ShmStream(true, m->base, m->bytes, m->fd, s->tag, capacity));
}

std::unique_ptr<ShmStream> ShmStream::open(pid_t pid, int fd, uint64_t tag, uint64_t capacity,
                                           std::string* why) {
  if (capacity < kMinStreamBytes || capacity > kMaxStreamBytes) {
    throw ProtocolError(str("peer offered a shared-memory stream of ", capacity,
                            " bytes (accepted: ", kMinStreamBytes, " to ", kMaxStreamBytes, ")"));
  }
  std::optional<PeerMapping> p =
      map_peer_memfd(pid, fd, kStreamMemfdName, "shared-memory stream",
                     kStreamDataOffset + capacity, kStreamDataOffset + capacity, why);
  if (!p) return nullptr;
  std::unique_ptr<ShmStream> s(new ShmStream(false, p->base, p->length, -1, tag, capacity));
  const Shared& h = *s->shared_;
  if (h.magic != kStreamMagic || h.tag != tag || h.capacity != capacity) {
    throw ProtocolError(str("peer's shared-memory stream ", fd,
                            " has a header that does not "
                            "match its offer (magic, tag or capacity)"));
  }
  return s;
}

uint64_t ShmStream::readable() {
  const uint64_t head = shared_->head.load(std::memory_order_acquire);
  if (head < tail_ || head - tail_ > capacity_) {
    throw ProtocolError(str("peer's shared-memory stream: head ", head, " against our tail ", tail_,
                            " in a ring of ", capacity_, " bytes"));
  }
  return head - tail_;
}

uint64_t ShmStream::writable() {
  const uint64_t tail = shared_->tail.load(std::memory_order_acquire);
  if (tail > head_ || head_ - tail > capacity_) {
    throw ProtocolError(str("peer's shared-memory stream: tail ", tail, " against our head ", head_,
                            " in a ring of ", capacity_, " bytes"));
  }
  tail_seen_ = tail;
  return capacity_ - (head_ - tail);
}

size_t ShmStream::write_some(const void* src, size_t n) {
  uint64_t room = capacity_ - (head_ - tail_seen_);
  if (room < n) room = writable();
  const size_t k = static_cast<size_t>(std::min<uint64_t>(n, room));
  if (k == 0) return 0;
  copy_ring(true, head_, const_cast<void*>(src), k);  // only read
  head_ += k;
  publish(shared_->head, head_, shared_->reader_waiting, shared_->reader_bell);
  return k;
}

size_t ShmStream::read_some(void* dst, size_t n) {
  const size_t k = static_cast<size_t>(std::min<uint64_t>(n, readable()));
  if (k == 0) return 0;
  copy_ring(false, tail_, dst, k);
  tail_ += k;
  publish(shared_->tail, tail_, shared_->writer_waiting, shared_->writer_bell);
  return k;
}

void ShmStream::copy_ring(bool into, uint64_t at, void* user_bytes, size_t k) {
  const iovec iov{user_bytes, k};
  byte_ring::copy(into ? byte_ring::Direction::kIntoRing : byte_ring::Direction::kOutOfRing,
                  reinterpret_cast<char*>(data_), static_cast<size_t>(capacity_), at, &iov, 1, k);
}

void ShmStream::wait(int64_t ns) {
  std::atomic<uint32_t>& waiting = writer_ ? shared_->writer_waiting : shared_->reader_waiting;
  std::atomic<uint32_t>& bell = writer_ ? shared_->writer_bell : shared_->reader_bell;
  // The bell is read before the flag is set: a wake between the look below and the sleep
  // changes it, and FUTEX_WAIT then returns at once.
  const uint32_t seen = bell.load(std::memory_order_acquire);
  waiting.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if ((writer_ ? writable() : readable()) == 0 && ns > 0) futex::wait(bell, seen, ns);
  waiting.store(0, std::memory_order_relaxed);
}

void ShmStream::wake_self() { ring_bell(writer_ ? shared_->writer_bell : shared_->reader_bell); }

}  // namespace tdist::rpc::detail

namespace tdist::rpc {

std::vector<double> shm_ring_round_trips(size_t bytes, int warmup, int iters) {
  using detail::ShmStream;
  using Clock = std::chrono::steady_clock;
  constexpr uint64_t kCapacity = 256 << 10;
  auto open_own = [](const ShmStream& w) {
    std::string why;
    auto r = ShmStream::open(::getpid(), w.fd(), w.tag(), w.capacity(), &why);
    TDIST_CHECK(r != nullptr, "cannot map a shared-memory ring: ", why);
    return r;
  };
  auto there = ShmStream::create(kCapacity), back = ShmStream::create(kCapacity);
  TDIST_CHECK(there && back, "no shared memory for the ring round trips");
  auto there_in = open_own(*there), back_in = open_own(*back);
  std::vector<uint8_t> out(bytes, 1), in(bytes);
  auto move = [](ShmStream& s, uint8_t* p, size_t n, bool write) {
    while (n > 0) {
      const size_t k = write ? s.write_some(p, n) : s.read_some(p, n);
      if (k == 0) std::this_thread::yield();
      p += k;
      n -= k;
    }
  };
  const int total = warmup + iters;
  std::thread echo([&] {
    std::vector<uint8_t> buf(bytes);
    for (int i = 0; i < total; ++i) {
      move(*there_in, buf.data(), bytes, false);
      move(*back, buf.data(), bytes, true);
    }
  });
  std::vector<double> times;
  for (int i = 0; i < total; ++i) {
    const auto t0 = Clock::now();
    move(*there, out.data(), bytes, true);
    move(*back_in, in.data(), bytes, false);
    if (i >= warmup) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  echo.join();
  return times;
}

}  // namespace tdist::rpc
