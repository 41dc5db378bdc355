#include "tdist/rpc/detail/shm_stream.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "tdist/core/error.h"
#include "tdist/core/futex.h"
#include "tdist/rpc/detail/shm_tensors.h"

namespace tdist::rpc::detail {
namespace {

constexpr char kMemfdName[] = "tdist-rpc-stream";

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
  std::optional<SealedMemfd> m = create_sealed_memfd(kMemfdName, kStreamDataOffset + capacity);
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
      map_peer_memfd(pid, fd, kMemfdName, "shared-memory stream", kStreamDataOffset + capacity, why);
  if (!p) return nullptr;
  std::unique_ptr<ShmStream> s(new ShmStream(false, p->base, p->length, -1, tag, capacity));
  const Shared& h = *s->shared_;
  if (h.magic != kStreamMagic || h.tag != tag || h.capacity != capacity) {
    throw ProtocolError(str("peer's shared-memory stream ", fd, " has a header that does not "
                            "match its offer (magic, tag or capacity)"));
  }
  return s;
}

uint64_t ShmStream::readable() {
  const uint64_t head = shared_->head.load(std::memory_order_acquire);
  if (head < tail_ || head - tail_ > capacity_) {
    throw ProtocolError(str("peer's shared-memory stream: head ", head, " against our tail ",
                            tail_, " in a ring of ", capacity_, " bytes"));
  }
  return head - tail_;
}

uint64_t ShmStream::writable() {
  const uint64_t tail = shared_->tail.load(std::memory_order_acquire);
  if (tail > head_ || head_ - tail > capacity_) {
    throw ProtocolError(str("peer's shared-memory stream: tail ", tail, " against our head ",
                            head_, " in a ring of ", capacity_, " bytes"));
  }
  return capacity_ - (head_ - tail);
}

size_t ShmStream::write_some(const void* src, size_t n) {
  const size_t k = static_cast<size_t>(std::min<uint64_t>(n, writable()));
  if (k == 0) return 0;
  const size_t pos = static_cast<size_t>(head_ % capacity_);
  const size_t first = std::min(k, static_cast<size_t>(capacity_) - pos);
  std::memcpy(data_ + pos, src, first);
  if (k > first) std::memcpy(data_, static_cast<const uint8_t*>(src) + first, k - first);
  head_ += k;
  shared_->head.store(head_, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (shared_->reader_waiting.load(std::memory_order_relaxed) != 0) {
    shared_->reader_bell.fetch_add(1, std::memory_order_release);
    futex::wake(shared_->reader_bell);
  }
  return k;
}

size_t ShmStream::read_some(void* dst, size_t n) {
  const size_t k = static_cast<size_t>(std::min<uint64_t>(n, readable()));
  if (k == 0) return 0;
  const size_t pos = static_cast<size_t>(tail_ % capacity_);
  const size_t first = std::min(k, static_cast<size_t>(capacity_) - pos);
  std::memcpy(dst, data_ + pos, first);
  if (k > first) std::memcpy(static_cast<uint8_t*>(dst) + first, data_, k - first);
  tail_ += k;
  shared_->tail.store(tail_, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (shared_->writer_waiting.load(std::memory_order_relaxed) != 0) {
    shared_->writer_bell.fetch_add(1, std::memory_order_release);
    futex::wake(shared_->writer_bell);
  }
  return k;
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

void ShmStream::wake_self() {
  std::atomic<uint32_t>& bell = writer_ ? shared_->writer_bell : shared_->reader_bell;
  bell.fetch_add(1, std::memory_order_release);
  futex::wake(bell);
}

}  // namespace tdist::rpc::detail
