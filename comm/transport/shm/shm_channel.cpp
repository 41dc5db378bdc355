#include "tdist/comm/transport/shm/shm_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>

#include "tdist/core/byte_ring.h"
#include "tdist/core/error.h"
#include "tdist/core/futex.h"
#include "tdist/core/logging.h"

namespace tdist::comm::shm {
namespace {

constexpr size_t kHeaderBytes = 2 * sizeof(RingHeader);
constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

}  // namespace

size_t segment_bytes(size_t capacity) { return kHeaderBytes + 2 * capacity; }

std::unique_ptr<Segment> Segment::create(size_t bytes) {
  const int fd = ::memfd_create("tdist-shm-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return nullptr;
  // fallocate reserves the pages now: a full tmpfs (small in many containers) then means "no
  // shared memory, use TCP" instead of SIGBUS on first touch.
  void* p = MAP_FAILED;
  if (::fchmod(fd, 0600) == 0 && ::ftruncate(fd, static_cast<off_t>(bytes)) == 0 &&
      ::fallocate(fd, 0, 0, static_cast<off_t>(bytes)) == 0 &&
      ::fcntl(fd, F_ADD_SEALS, kSeals) == 0) {
    p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  }
  if (p == MAP_FAILED) {
    ::close(fd);
    return nullptr;
  }
  auto* headers = static_cast<RingHeader*>(p);
  for (int i = 0; i < 2; ++i) {
    new (&headers[i]) RingHeader();
    headers[i].head.store(0);
    headers[i].tail.store(0);
    headers[i].reader_waiting.store(0);
    headers[i].writer_waiting.store(0);
    headers[i].bell.store(0);
  }
  return std::unique_ptr<Segment>(new Segment(static_cast<char*>(p), bytes, fd));
}

std::unique_ptr<Segment> Segment::map_peer(int fd, size_t bytes, std::string* why) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    *why = "the peer's segment is not a regular file";
    return nullptr;
  }
  if (st.st_uid != ::geteuid()) {
    *why = str("the peer's segment belongs to uid ", st.st_uid);
    return nullptr;
  }
  if ((st.st_mode & 077) != 0) {
    *why =
        str("the peer's segment has mode 0", std::oct, st.st_mode & 0777, " (others may open it)");
    return nullptr;
  }
  if (static_cast<uint64_t>(st.st_size) != bytes) {
    *why = str("the peer's segment has ", st.st_size, " bytes, not the ", bytes, " agreed");
    return nullptr;
  }
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & kSeals) != kSeals) {
    *why = "the peer's segment is not sealed against resizing";
    return nullptr;
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    *why = str("cannot map the peer's segment: ", std::strerror(errno));
    return nullptr;
  }
  return std::unique_ptr<Segment>(new Segment(static_cast<char*>(p), bytes, -1));
}

void Segment::close_fd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Segment::~Segment() {
  ::munmap(data_, size_);
  close_fd();
}

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

void ShmChannel::wake_peer(uint32_t how) {
  if (how == kWakeByBell) {
    tx_->bell.fetch_add(1, std::memory_order_release);  // the peer's bell: in the ring it reads
    futex::wake(tx_->bell);
    return;
  }
  char b = 1;
  iovec iov{&b, 1};
  conn_->writev(&iov, 1);  // a full socket already holds a wake-up; errors show up as EOF
}

void ShmChannel::shutdown() {
  conn_->shutdown();
  rx_->bell.fetch_add(1, std::memory_order_release);  // our own bell: a sleeper here wakes up
  futex::wake(rx_->bell);
}

long ShmChannel::fail_protocol() {
  closed_ = true;
  close_errno_ = EPROTO;
  conn_->shutdown();
  errno = EPROTO;
  return -1;
}

long ShmChannel::readable() {
  if (close_errno_ == EPROTO) {  // stays failed even if the peer puts the counter back
    errno = EPROTO;
    return -1;
  }
  const uint64_t head = rx_->head.load(std::memory_order_acquire);
  const uint64_t avail = head - rx_tail_;  // unsigned: a head behind our tail is huge too
  if (avail > capacity_) return fail_protocol();
  return static_cast<long>(avail);
}

long ShmChannel::writable() {
  const uint64_t tail = tx_->tail.load(std::memory_order_acquire);
  const uint64_t used = tx_head_ - tail;  // unsigned: a tail ahead of our head is huge too
  if (used > capacity_) return fail_protocol();
  tx_tail_seen_ = tail;
  return static_cast<long>(capacity_ - used);
}

long ShmChannel::writev(const iovec* iov, int count) {
  if (closed_) {
    errno = close_errno_ != 0 ? close_errno_ : EPIPE;
    return kError;
  }
  size_t wanted = 0;
  for (int i = 0; i < count; ++i) wanted += iov[i].iov_len;
  long space = static_cast<long>(capacity_ - (tx_head_ - tx_tail_seen_));
  if (static_cast<size_t>(space) < wanted) space = writable();
  if (space < 0) return kError;
  const size_t moved = byte_ring::copy(byte_ring::Direction::kIntoRing, tx_data_, capacity_,
                                       tx_head_, iov, count, static_cast<size_t>(space));
  if (moved == 0) return 0;
  tx_head_ += moved;
  tx_->head.store(tx_head_, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (uint32_t how = tx_->reader_waiting.load(std::memory_order_relaxed)) wake_peer(how);
  return static_cast<long>(moved);
}

long ShmChannel::readv(const iovec* iov, int count) {
  const long avail = readable();
  if (avail < 0) return kError;
  if (avail == 0) return closed_ ? kClosed : 0;
  const size_t moved = byte_ring::copy(byte_ring::Direction::kOutOfRing, rx_data_, capacity_,
                                       rx_tail_, iov, count, static_cast<size_t>(avail));
  consume(moved);
  return static_cast<long>(moved);
}

long ShmChannel::peek(iovec spans[2]) {
  const long readable_now = readable();
  if (readable_now < 0) return kError;
  const size_t avail = static_cast<size_t>(readable_now);
  if (avail == 0) return closed_ ? kClosed : 0;
  const size_t pos = static_cast<size_t>(rx_tail_ % capacity_);
  const size_t first = std::min(avail, capacity_ - pos);
  spans[0] = iovec{rx_data_ + pos, first};
  spans[1] = iovec{rx_data_, avail - first};
  return static_cast<long>(avail);
}

void ShmChannel::consume(size_t n) {
  if (n == 0) return;
  rx_tail_ += n;
  rx_->tail.store(rx_tail_, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (uint32_t how = rx_->writer_waiting.load(std::memory_order_relaxed)) wake_peer(how);
}

bool ShmChannel::announce_wait(bool want_read, bool want_write, uint32_t how) {
  if (want_read) rx_->reader_waiting.store(how, std::memory_order_relaxed);
  if (want_write) tx_->writer_waiting.store(how, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  // An impossible counter counts as ready: the next readv/writev reports it.
  bool ready = closed_ || (want_read && rx_->head.load(std::memory_order_acquire) != rx_tail_) ||
               (want_write && tx_head_ - tx_->tail.load(std::memory_order_acquire) != capacity_);
  if (ready) clear_wait();
  return ready;
}

void ShmChannel::clear_wait() {
  rx_->reader_waiting.store(0, std::memory_order_relaxed);
  tx_->writer_waiting.store(0, std::memory_order_relaxed);
}

bool ShmChannel::prepare_wait(bool want_read, bool want_write, pollfd& pfd) {
  if (announce_wait(want_read, want_write, kWakeBySocket)) return false;
  pfd = pollfd{conn_->fd(), POLLIN, 0};
  return true;
}

bool ShmChannel::wait_alone(bool want_read, bool want_write,
                            std::chrono::steady_clock::time_point deadline) {
  using std::chrono::steady_clock;
  // Read before the flags go up: a bump after this makes FUTEX_WAIT return at once.
  const uint32_t seen = rx_->bell.load(std::memory_order_acquire);
  if (announce_wait(want_read, want_write, kWakeByBell)) return true;
  bool woken = false;
  for (;;) {
    const auto now = steady_clock::now();
    if (now >= deadline) break;
    const auto slice = std::min<steady_clock::duration>(deadline - now, kLivenessSlice);
    futex::wait(rx_->bell, seen,
                std::chrono::duration_cast<std::chrono::nanoseconds>(slice).count());
    if (rx_->bell.load(std::memory_order_acquire) != seen) {
      woken = true;
      break;
    }
    // A slice passed (or a signal came): has the peer gone? End-of-file is only on the socket.
    pollfd pfd{conn_->fd(), POLLIN, 0};
    if (::poll(&pfd, 1, 0) > 0) {
      after_wait(pfd.revents);  // clears the flags too
      return true;
    }
  }
  clear_wait();
  return woken;
}

void ShmChannel::after_wait(short revents) {
  clear_wait();
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
