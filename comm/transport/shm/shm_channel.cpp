#include "tdist/comm/transport/shm/shm_channel.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

namespace tdist::comm::shm {
namespace {
constexpr size_t kHeaderBytes = 2 * sizeof(RingHeader);
}

size_t segment_bytes(size_t capacity) { return kHeaderBytes + 2 * capacity; }

std::unique_ptr<Segment> Segment::create(const std::string& name, size_t bytes) {
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return nullptr;
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    return nullptr;
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    return nullptr;
  }
  auto* headers = static_cast<RingHeader*>(p);
  for (int i = 0; i < 2; ++i) {
    new (&headers[i]) RingHeader();
    headers[i].head.store(0);
    headers[i].tail.store(0);
    headers[i].reader_waiting.store(0);
    headers[i].writer_waiting.store(0);
  }
  return std::unique_ptr<Segment>(new Segment(static_cast<char*>(p), bytes));
}

std::unique_ptr<Segment> Segment::open(const std::string& name, size_t bytes) {
  int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return nullptr;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
    ::close(fd);
    return nullptr;
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return nullptr;
  return std::unique_ptr<Segment>(new Segment(static_cast<char*>(p), bytes));
}

void Segment::unlink(const std::string& name) { ::shm_unlink(name.c_str()); }

Segment::~Segment() { ::munmap(data_, size_); }

ShmChannel::ShmChannel(std::unique_ptr<Segment> segment, size_t capacity, bool is_lower,
                       tcp::Connection* conn)
    : segment_(std::move(segment)), capacity_(capacity), conn_(conn) {
  auto* headers = reinterpret_cast<RingHeader*>(segment_->data());
  char* first = segment_->data() + kHeaderBytes;
  char* second = first + capacity_;
  tx_ = is_lower ? &headers[0] : &headers[1];
  rx_ = is_lower ? &headers[1] : &headers[0];
  tx_data_ = is_lower ? first : second;
  rx_data_ = is_lower ? second : first;
}

void ShmChannel::ring_doorbell() {
  char b = 1;
  iovec iov{&b, 1};
  conn_->writev(&iov, 1);  // a full socket already holds a wake-up; errors show up as EOF
}

long ShmChannel::writev(const iovec* iov, int count) {
  if (closed_) {
    errno = close_errno_ != 0 ? close_errno_ : EPIPE;
    return kError;
  }
  const uint64_t head = tx_->head.load(std::memory_order_relaxed);
  const uint64_t tail = tx_->tail.load(std::memory_order_acquire);
  size_t space = capacity_ - static_cast<size_t>(head - tail);
  size_t moved = 0;
  for (int i = 0; i < count && space > 0; ++i) {
    const char* src = static_cast<const char*>(iov[i].iov_base);
    size_t len = std::min(iov[i].iov_len, space);
    size_t done = 0;
    while (done < len) {
      size_t pos = static_cast<size_t>((head + moved) % capacity_);
      size_t n = std::min(len - done, capacity_ - pos);
      std::memcpy(tx_data_ + pos, src + done, n);
      done += n;
      moved += n;
    }
    space -= len;
    if (len < iov[i].iov_len) break;
  }
  if (moved == 0) return 0;
  tx_->head.store(head + moved, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (tx_->reader_waiting.load(std::memory_order_relaxed) != 0) ring_doorbell();
  return static_cast<long>(moved);
}

long ShmChannel::readv(const iovec* iov, int count) {
  const uint64_t tail = rx_->tail.load(std::memory_order_relaxed);
  const uint64_t head = rx_->head.load(std::memory_order_acquire);
  size_t avail = static_cast<size_t>(head - tail);
  if (avail == 0) return closed_ ? kClosed : 0;
  size_t moved = 0;
  for (int i = 0; i < count && avail > 0; ++i) {
    char* dst = static_cast<char*>(iov[i].iov_base);
    size_t len = std::min(iov[i].iov_len, avail);
    size_t done = 0;
    while (done < len) {
      size_t pos = static_cast<size_t>((tail + moved) % capacity_);
      size_t n = std::min(len - done, capacity_ - pos);
      std::memcpy(dst + done, rx_data_ + pos, n);
      done += n;
      moved += n;
    }
    avail -= len;
    if (len < iov[i].iov_len) break;
  }
  rx_->tail.store(tail + moved, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (rx_->writer_waiting.load(std::memory_order_relaxed) != 0) ring_doorbell();
  return static_cast<long>(moved);
}

long ShmChannel::peek(iovec spans[2]) {
  const uint64_t tail = rx_->tail.load(std::memory_order_relaxed);
  const uint64_t head = rx_->head.load(std::memory_order_acquire);
  size_t avail = static_cast<size_t>(head - tail);
  if (avail == 0) return closed_ ? kClosed : 0;
  size_t pos = static_cast<size_t>(tail % capacity_);
  size_t first = std::min(avail, capacity_ - pos);
  spans[0] = iovec{rx_data_ + pos, first};
  spans[1] = iovec{rx_data_, avail - first};
  return static_cast<long>(avail);
}

void ShmChannel::consume(size_t n) {
  if (n == 0) return;
  rx_->tail.store(rx_->tail.load(std::memory_order_relaxed) + n, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (rx_->writer_waiting.load(std::memory_order_relaxed) != 0) ring_doorbell();
}

bool ShmChannel::prepare_wait(bool want_read, bool want_write, pollfd& pfd) {
  if (want_read) rx_->reader_waiting.store(1, std::memory_order_relaxed);
  if (want_write) tx_->writer_waiting.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  bool ready = closed_ ||
               (want_read && rx_->head.load(std::memory_order_acquire) !=
                                 rx_->tail.load(std::memory_order_relaxed)) ||
               (want_write && tx_->head.load(std::memory_order_relaxed) -
                                      tx_->tail.load(std::memory_order_acquire) <
                                  capacity_);
  if (ready) {
    rx_->reader_waiting.store(0, std::memory_order_relaxed);
    tx_->writer_waiting.store(0, std::memory_order_relaxed);
    return false;
  }
  pfd = pollfd{conn_->fd(), POLLIN, 0};
  return true;
}

void ShmChannel::after_wait(short revents) {
  rx_->reader_waiting.store(0, std::memory_order_relaxed);
  tx_->writer_waiting.store(0, std::memory_order_relaxed);
  if (revents == 0) return;
  char buf[256];
  for (;;) {
    iovec iov{buf, sizeof(buf)};
    long n = conn_->readv(&iov, 1);
    if (n > 0) continue;
    if (n == kClosed || n == kError) {
      close_errno_ = n == kError ? errno : 0;
      closed_ = true;
    }
    return;
  }
}

}  // namespace tdist::comm::shm
