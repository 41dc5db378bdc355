#pragma once
// ShmChannel: a Channel between two processes (or threads) of one host through a shared-memory
// segment holding one ring per direction. Copying into and out of a ring costs two memcpy per
// byte and no kernel work, where loopback TCP costs two copies plus the TCP stack; on a small
// machine that is the difference between ~1.5 GB/s and memory speed.
//
// Note [Shared-memory rings]
//   Each direction is a ring of `capacity` bytes with two monotonically increasing counters:
//   head (bytes produced, written only by the sender) and tail (bytes consumed, written only by
//   the receiver). The sender copies into [head, head+space) and publishes with a release store
//   of head; the receiver copies out of [tail, head) and publishes with a release store of tail.
//   The sender keeps the tail as it last loaded it and loads it again only when the space that
//   leaves cannot take the whole write: the tail sits on a cache line the receiver writes, so
//   each load is a transfer between cores, which a small message no longer waits for before it
//   is written (docs/perf.md, "The sender's view of the tail"). The receiver loads the head on
//   every read: a reader that needs more than it has (a partial element) must see new bytes.
//   Sleeping uses the pair's TCP connection as a doorbell: before sleeping, a side sets its
//   waiting flag in the ring it waits on (reader_waiting when it needs data, writer_waiting when
//   it needs space), issues a seq_cst fence and re-checks the counters; only then does it poll
//   the TCP socket. A side that moves a counter issues a seq_cst fence and, if the other side's
//   flag is set, writes one byte to the socket. The two fences make it impossible for both to
//   miss each other (Dekker). Every byte on the socket only means "look again" and is drained
//   after waking. The socket also carries liveness: end-of-file (the peer exited, crashed or
//   aborted) makes reads fail once the ring is empty and writes fail at once.
//
//   When this channel is the only one a rank waits on (always at world 2, and in a ring whenever
//   the send to the next rank has gone into its ring), the side sleeps on a futex instead of the
//   socket (wait_alone): each side has a 32-bit bell in the ring it reads (RingHeader::bell); a
//   waiting flag of kWakeByBell asks the peer to bump that bell and FUTEX_WAKE it instead of
//   writing a byte. The sleeper reads the bell before setting its flags, so a bump between its
//   re-check and its sleep makes FUTEX_WAIT return at once. A futex wake skips the socket's
//   write, its poll wake-up and the drain: measured in docs/perf-history.md ("Waking a rank").
//   A futex does not see the socket, so the sleep is cut into slices of kLivenessSlice, after
//   each of which the socket is polled once (a dead peer is noticed within a slice), and
//   shutdown() rings this side's own bell (an abort wakes the sleeper at once).
//
//   The segment is writable by the peer, so nothing in it is trusted: each side keeps its own
//   counter (head when sending, tail when receiving) in private memory and only publishes it,
//   and checks every counter it loads from the peer against it. A head more than `capacity` bytes
//   ahead of our tail, or a tail behind our head by more than `capacity` or ahead of it, would
//   make us copy outside the ring: the channel fails instead (EPROTO, "protocol error"), as does
//   a segment offered with a capacity below kMinCapacity.
//
// Thread safety: one thread does I/O on a channel; shutdown() may come from any thread.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "tdist/comm/transport/channel.h"
#include "tdist/comm/transport/tcp/connection.h"

namespace tdist::comm::shm {

// A segment of shared memory mapped into this process: an anonymous memfd that its creator (the
// lower rank of a pair) hands to its peer over the local link (comm/transport/shm/local_link.h),
// never a name that another process could open or replace. It is sealed against resizing
// (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL): a creator that could shrink it after its peer
// mapped it would turn the peer's next touch of it into SIGBUS. Unmapped on destruction.
class Segment {
 public:
  // Creates a sealed memfd of `bytes` (mode 0600, its pages reserved) and maps it; nullptr when
  // shared memory is unavailable. fd() stays open until close_fd() or destruction.
  static std::unique_ptr<Segment> create(size_t bytes);
  // Maps the peer's segment `fd` (not taken: the caller closes it). nullptr, and `why`, unless
  // it is a regular file of our effective uid that no one else may open (mode 0600 or
  // narrower), exactly `bytes` long and sealed as create() seals: the size is the one this rank
  // agreed to, never more, and cannot change under the mapping.
  static std::unique_ptr<Segment> map_peer(int fd, size_t bytes, std::string* why);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }  // the creator's descriptor; -1 once closed or when mapped
  void close_fd();

 private:
  Segment(char* data, size_t size, int fd) : data_(data), size_(size), fd_(fd) {}
  char* data_;
  size_t size_;
  int fd_;
};

struct RingHeader {
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
  alignas(64) std::atomic<uint32_t> reader_waiting;
  alignas(64) std::atomic<uint32_t> writer_waiting;
  alignas(64) std::atomic<uint32_t> bell;  // futex word of this ring's reader (wait_alone)
};

// Values of reader_waiting / writer_waiting: how the waiting side wants to be woken.
inline constexpr uint32_t kWakeBySocket = 1;
inline constexpr uint32_t kWakeByBell = 2;
// How long a futex sleep lasts before the socket is checked for a dead peer.
inline constexpr std::chrono::milliseconds kLivenessSlice{10};

// Bytes of a segment holding two rings of `capacity` bytes each.
size_t segment_bytes(size_t capacity);

// The smallest and largest ring capacity either side accepts (TDIST_SHM_BYTES, a peer's offer).
inline constexpr size_t kMinCapacity = 4096;
inline constexpr size_t kMaxCapacity = size_t(1) << 32;

class ShmChannel final : public Channel {
 public:
  // `is_lower`: this rank is the lower of the pair (it owns the first ring for sending).
  // `conn` (not owned) is the pair's TCP connection, used as doorbell and liveness signal.
  ShmChannel(std::unique_ptr<Segment> segment, size_t capacity, bool is_lower,
             tcp::Connection* conn);

  int peer() const override { return conn_->peer(); }
  const char* kind() const override { return "shm"; }
  long writev(const iovec* iov, int count) override;
  long readv(const iovec* iov, int count) override;
  bool prepare_wait(bool want_read, bool want_write, pollfd& pfd) override;
  void after_wait(short revents) override;
  bool can_wait_alone() const override { return true; }
  bool wait_alone(bool want_read, bool want_write,
                  std::chrono::steady_clock::time_point deadline) override;
  void shutdown() override;
  bool supports_peek() const override { return true; }
  long peek(iovec spans[2]) override;
  void consume(size_t n) override;

 private:
  // Wakes the peer the way its waiting flag `how` asks (kWakeBySocket or kWakeByBell).
  void wake_peer(uint32_t how);
  // Sets the waiting flags to `how` and re-checks the counters (Note [Shared-memory rings]);
  // true when progress is possible already (the flags are cleared again).
  bool announce_wait(bool want_read, bool want_write, uint32_t how);
  void clear_wait();
  // The bytes readable now (the peer's head against our tail) and the bytes free to write (the
  // peer's tail against our head); -1 after marking the channel failed when the peer's counter is
  // impossible (reads then keep failing).
  long readable();
  long writable();
  long fail_protocol();

  const std::unique_ptr<Segment> segment_;
  const size_t capacity_;
  tcp::Connection* const conn_;
  RingHeader* tx_;
  RingHeader* rx_;
  char* tx_data_;
  char* rx_data_;
  uint64_t tx_head_ = 0;       // ours: bytes produced into tx_ (published as tx_->head)
  uint64_t tx_tail_seen_ = 0;  // the peer's tail as writable() last read and checked it
  uint64_t rx_tail_ = 0;       // ours: bytes consumed from rx_ (published as rx_->tail)
  bool closed_ = false;
  int close_errno_ = 0;
};

}  // namespace tdist::comm::shm
