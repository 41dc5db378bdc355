#pragma once
// A connection's frames between two processes of one host through shared memory instead of TCP.
//
// Note [RPC shared-memory frame streams]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A small call's round trip over loopback TCP costs four sendmsg/recv crossings of the kernel's
// network stack and their wake-ups; a bare TCP ping-pong alone takes about as long as the round
// trip RPC aims for (docs/perf-history.md, "The RPC round trip"). So once both ends know they
// share a host (the same-host fast path of Note [RPC handshake]), each direction of a connection
// moves its frames through a ring in shared memory, and the socket is kept only to see the peer
// die.
//
// - The ring is a memfd made and sealed by its writer (create_sealed_memfd in
//   rpc/detail/shm_tensors.h): a header page (magic, a random tag, the capacity; then, each on
//   its own cache line, head = bytes produced, written only by the writer, and tail = bytes
//   consumed, written only by the reader, and the two sides' futex words), then `capacity`
//   bytes of data. The byte stream is exactly what TCP would carry (Note [RPC wire format]).
// - Switching, per direction, with three frames (MessageType; only the offer has a body):
//     writer -> reader, on the socket: STREAM_OFFER (id = tag; body: the memfd's descriptor
//       number and the capacity). The writer goes on writing to the socket.
//     reader -> writer, on the reader's own path: STREAM_ACCEPT (id = tag) once it mapped the
//       ring (opening /proc/<writer pid>/fd/<n>, allowed by the same kernel check as the slots;
//       a ring it cannot map it does not accept, and the direction stays on TCP).
//     writer -> reader, on the socket: STREAM_SWITCH (id = tag), the last bytes the writer ever
//       writes to the socket; every later frame is in the ring. The reader that reads it reads
//       the ring from then on (a byte on the socket after it is a ProtocolError).
//   The writer closes its descriptor of the ring as soon as the acceptance comes (the mappings
//   stay), so a ring holds a descriptor only for the round trip of its offer.
// - Waiting: a reader between frames spins first (ConnectionOptions::spin: each look is a load
//   of the head, not a recv, and the core is yielded between looks), then sleeps on its futex; a writer whose ring is full sleeps
//   on its own. Before sleeping a side sets its waiting flag, issues a seq_cst fence and looks
//   again; a side that moves a counter issues a seq_cst fence and wakes the other when its flag
//   is set (Dekker, as Note [Shared-memory rings] in comm/transport/shm/shm_channel.h). A sleep
//   lasts at most kStreamLivenessSlice, after which the socket is polled: end-of-file there (the
//   peer exited, crashed or closed) ends the stream once the ring is drained, and close() wakes
//   its own side's sleepers at once. A reader that stays idle doubles its slice up to
//   kStreamIdleSlice, so an idle worker with many peers wakes a few times a second per
//   connection, and a peer's death is seen within that slice. The frame timeout and the send timeout bound the waits as
//   they bound recv and sendmsg.
// - The writer keeps the tail it last loaded and loads it again only when the room that leaves
//   cannot take the whole write: the tail sits on a line the reader writes at every read, and a
//   small frame need not wait for it (as Note [Shared-memory rings] in
//   comm/transport/shm/shm_channel.h).
// - The ring is writable by the peer, so nothing in it is trusted: each side keeps its own
//   counter privately and checks the peer's against it (a head more than `capacity` ahead of our
//   tail, or a tail behind our head by more than `capacity` or ahead of it, is a
//   ProtocolError), and a ring that is not a sealed memfd of our name, or whose header does not
//   match the offer, is refused the same way.
//
// Thread safety: one thread writes (the connection's writing thread) or reads (its reader
// thread) a stream; wake_self() from any thread.

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace tdist::rpc::detail {

// The smallest and largest ring a reader accepts.
constexpr uint64_t kMinStreamBytes = 4096;
constexpr uint64_t kMaxStreamBytes = uint64_t{64} << 20;
// The first word of a ring's header page ("TDRPCSTR") and where its data starts.
constexpr uint64_t kStreamMagic = 0x5254534350524454;
constexpr uint64_t kStreamDataOffset = 4096;
// How long a sleep on a stream lasts before the socket is looked at for a dead peer; a reader
// that keeps finding nothing doubles it, up to kStreamIdleSlice.
constexpr std::chrono::milliseconds kStreamLivenessSlice{10};
constexpr std::chrono::milliseconds kStreamIdleSlice{160};

class ShmStream {
 public:
  // The writing side: a new ring of `capacity` bytes; nullptr (errno set) when no shared memory
  // can be had.
  static std::unique_ptr<ShmStream> create(uint64_t capacity);
  // The reading side: the ring that process `pid` offered as descriptor `fd`, tag `tag`,
  // `capacity` bytes. nullptr when /proc does not let us map it (`why` says why);
  // ProtocolError when it is not one or its header contradicts the offer.
  static std::unique_ptr<ShmStream> open(pid_t pid, int fd, uint64_t tag, uint64_t capacity,
                                         std::string* why);
  ~ShmStream();
  ShmStream(const ShmStream&) = delete;
  ShmStream& operator=(const ShmStream&) = delete;

  int fd() const { return fd_; }
  uint64_t tag() const { return tag_; }
  uint64_t capacity() const { return capacity_; }
  // The reader has mapped the ring: the writer's descriptor is not needed any more (called on
  // the writer's reader thread; the writing thread reads fd() only before it offers the ring).
  void close_fd();

  // Writer: copies as much of `n` bytes at `src` as fits and publishes it; returns the bytes
  // copied (0: the ring is full).
  size_t write_some(const void* src, size_t n);
  // Reader: copies up to `n` readable bytes to `dst` and frees their room; returns them (0:
  // nothing yet).
  size_t read_some(void* dst, size_t n);
  // Sleeps until the peer may have moved the ring (written, for a reader; read, for a writer),
  // wake_self() was called or `ns` nanoseconds passed. The caller looks again.
  void wait(int64_t ns);
  // Wakes this side's sleeper in wait() (the connection is closing).
  void wake_self();

  // The header page, as both sides see it.
  struct Shared {
    uint64_t magic;
    uint64_t tag;
    uint64_t capacity;
    alignas(64) std::atomic<uint64_t> head;
    alignas(64) std::atomic<uint64_t> tail;
    alignas(64) std::atomic<uint32_t> reader_waiting;
    std::atomic<uint32_t> reader_bell;  // the reader sleeps on it
    alignas(64) std::atomic<uint32_t> writer_waiting;
    std::atomic<uint32_t> writer_bell;  // the writer sleeps on it
  };
  Shared* shared() const { return shared_; }

 private:
  ShmStream(bool writer, void* base, size_t length, int fd, uint64_t tag, uint64_t capacity);
  // Copies `k` bytes between the ring at stream offset `at` (wrapping at the end) and `user`.
  void copy_ring(bool into, uint64_t at, void* user, size_t k);
  uint64_t readable();  // reader: bytes the peer published beyond our tail
  uint64_t writable();  // writer: room the peer freed behind our head

  const bool writer_;
  void* const base_;
  const size_t length_;
  int fd_;
  const uint64_t tag_;
  const uint64_t capacity_;
  Shared* const shared_;
  uint8_t* const data_;
  uint64_t head_ = 0;       // writer: bytes produced (published as Shared::head)
  uint64_t tail_seen_ = 0;  // writer: the peer's tail as writable() last loaded and checked it
  uint64_t tail_ = 0;       // reader: bytes consumed (published as Shared::tail)
};

}  // namespace tdist::rpc::detail
