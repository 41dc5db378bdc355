#pragma once
// Exchange: the progress engine of one collective at a time on one group's collective channel.
//
// An algorithm posts sends and receives per peer (each peer's queue is a byte stream in posting
// order), then calls run(), which moves bytes with non-blocking writev/readv on the caller's own
// thread (no I/O thread, no hop per message) and waits in poll() only when no socket can make
// progress, after an optional short spin (when a single shared-memory peer is all it waits for,
// it sleeps on that channel's futex instead: Note [Shared-memory rings]). Every completed
// receive calls the algorithm's callback with the item's cookie; the callback may post more
// sends and receives (this is how the ring algorithms reduce chunk k while chunk k+1 is still
// arriving, and forward it at once).
//
// Queues are vectors that keep their capacity across operations: no allocation per message
// once a group has warmed up.
//
// Errors (thrown from run): TimeoutError when the deadline passes, NetworkError when a peer
// closes the connection or a socket fails, Error("... aborted") when the group was aborted.
// Every message names this rank, the operation, its sequence number, the peer and how many bytes
// had moved.
//
// Thread safety: one thread (the group's worker) uses an Exchange; none of it is shared.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tdist/comm/engine/reduce_kernels.h"
#include "tdist/comm/transport/channel.h"
#include "tdist/comm/transport/tcp/connection.h"

namespace tdist::comm::detail {

using Clock = std::chrono::steady_clock;

// Memory that another engine fills while an operation runs, piece by piece in a fixed order (a
// device-to-host copy: Note [Overlapped staging] in algorithms/overlapped_staging.h). arrived(k) says,
// without blocking, whether pieces 0..k hold their values.
class Arrivals {
 public:
  virtual ~Arrivals() = default;
  virtual bool arrived(size_t piece) = 0;
};

// What a posted transfer waits for before it touches its memory: `sent` bytes of this operation
// sent to `peer` (flow control: an algorithm reuses memory after those bytes left), and piece
// `piece` of `arrivals` (the memory's values are still being copied in). `sent` counts from the
// operation's start, not the algorithm's: an algorithm that runs more than once in one operation
// (once per window, Note [Windows]) adds what was posted before it started (posted_to).
struct Gate {
  int peer = -1;
  uint64_t sent = 0;
  Arrivals* arrivals = nullptr;
  size_t piece = 0;
};

class Exchange {
 public:
  // `peers` indexed by rank (nullptr at `rank`); `aborted` is the group's abort flag.
  Exchange(std::vector<Channel*> peers, int rank, const std::atomic<bool>* aborted);

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(peers_.size()); }
  // Bytes posted to `peer` so far in this operation (the origin of a Gate's `sent`).
  uint64_t posted_to(int peer) const { return sends_[peer].posted; }

  // Starts an operation at `now`: clears the queues and sets what errors will name.
  void begin(const char* op, uint64_t seq, Clock::time_point now, Clock::time_point deadline);
  const char* op() const { return op_; }
  uint64_t seq() const { return seq_; }

  // Posts `n` bytes to send to / receive from `peer` (appended to that peer's stream).
  // Zero-byte posts are ignored. The memory must stay valid until run() returns. A send does not
  // start before its gate opens (nor does anything posted after it to the same peer).
  void send(int peer, const void* data, size_t n, Gate gate = {});
  void recv(int peer, void* data, size_t n, uint64_t cookie = 0);
  // Receives `n` bytes and drops them unread: a signal whose arrival is all that counts (a
  // barrier's token). On shared memory the bytes' cache lines never move to this core.
  void skip(int peer, size_t n, uint64_t cookie = 0) { recv(peer, nullptr, n, cookie); }
  // Receives `n` bytes (whole elements of `elem` bytes) and reduces them as they arrive:
  // out = other op incoming (`out` may alias `other`). On shared memory the kernel reads the
  // ring directly (no copy); on TCP through a bounce buffer. `out` must not be sent meanwhile.
  // The receive does not start before its gate opens.
  void recv_reduce(int peer, void* out, const void* other, size_t n, ReduceFn fn, size_t elem,
                   uint64_t cookie = 0, Gate gate = {});

  // Progresses every posted transfer until all are complete. fn(peer, cookie) runs for every
  // completed receive in stream order (it may post more). Throws as described above.
  template <typename F>
  void run(F&& fn) {
    run_impl(&invoke<F>, &fn);
  }
  void run() { run_impl(nullptr, nullptr); }

  // Sends the `n` bytes at `mine` to every other rank, receives each one's `n` bytes into
  // theirs + rank * n (this rank's slot is left as it is), and runs until all have moved. The
  // sends wait for `gate`.
  void swap_with_all(const void* mine, void* theirs, size_t n, Gate gate = {});

  // Microseconds to keep retrying non-blocking I/O before sleeping in poll (TDIST_SPIN_US).
  void set_spin_us(int us) { spin_us_ = us; }
  // Nanoseconds at the start of each spin that re-try without yielding the core (a CPU pause
  // between tries instead): Note [Spin, then sleep] in ring_process_group.cpp.
  void set_busy_poll_ns(int ns) { busy_poll_ns_ = ns; }
  // Whether a lone shared-memory peer is waited for on its futex (TDIST_SHM_FUTEX) or polled.
  void set_wait_alone(bool on) { wait_alone_ = on; }

  // What the current operation (since begin()) did on this rank; tests count an algorithm's
  // steps, bytes and wake-ups with it (tests/comm/scaling_counts_test.cpp), benchmarks may too.
  struct Counts {
    uint64_t runs = 0;            // run() calls: rounds that wait for everything posted
    uint64_t sends = 0;           // non-empty send posts (a ring's hops, chunk by chunk)
    uint64_t bytes_sent = 0;      // bytes posted to send
    uint64_t bytes_received = 0;  // bytes posted to receive (plain or reduced)
    uint64_t forwards = 0;        // sends posted by a completion callback of run(): each
                                  // waited for a receive, so a chain of them is as many
                                  // dependent hand-offs (a wake-up each where a rank sleeps)
    uint64_t sleeps = 0;          // waits in poll or on a channel's futex: a wake-up each
    uint64_t spins_run_out = 0;   // spins that ended without progress (Note [Spin, then sleep])
  };
  const Counts& counts() const { return counts_; }

  // "rank 0: allreduce (seq 7)" for error messages.
  std::string where() const;

 private:
  struct Item {
    Item(char* d, size_t n, uint64_t c, Gate g = {}) : data(d), size(n), cookie(c), gate(g) {}
    char* data;
    size_t size;
    size_t done = 0;
    uint64_t cookie;
    const char* other = nullptr;  // recv_reduce: the second operand
    ReduceFn fn = nullptr;        // recv_reduce: the kernel
    size_t elem = 0;              // recv_reduce: element bytes
    Gate gate;                    // the item starts once it is open (Exchange::open)
  };
  struct Queue {
    std::vector<Item> items;
    size_t head = 0;
    uint64_t posted = 0;  // bytes posted this operation
    uint64_t moved = 0;   // bytes completed this operation
    bool pending() const { return head < items.size(); }
  };
  using Callback = void (*)(void* ctx, int peer, uint64_t cookie);
  template <typename F>
  static void invoke(void* ctx, int peer, uint64_t cookie) {
    (*static_cast<F*>(ctx))(peer, cookie);
  }

  void run_impl(Callback cb, void* ctx);
  // Whether an item's gate is open (an arrival seen once is remembered in the gate).
  bool open(Item& it);
  // Whether the head send to / receive from `peer` may move bytes (pending and open).
  bool send_ready(int peer);
  bool recv_ready(int peer);
  // The first pending head item held by its arrivals alone, or null.
  const Item* held_by_arrivals();
  bool progress_send(int peer);
  bool progress_recv(int peer, Callback cb, void* ctx);
  bool progress_reduce(int peer, Callback cb, void* ctx);
  bool progress_skip(int peer, Callback cb, void* ctx);
  void complete_head(Queue& q, int peer, Callback cb, void* ctx);
  size_t reduce_spans(Item& it, const iovec spans[2], size_t budget);
  void apply(Item& it, char* out, const char* other, const char* src, size_t count);
  size_t reduce_bounce(int peer, Item& it, bool& read);
  void wait_for_io();
  [[noreturn]] void fail_closed(int peer, const char* direction, int err);
  [[noreturn]] void fail_timeout();
  void check_aborted() const;

  // Constant after construction.
  const std::vector<Channel*> peers_;
  const int rank_;
  const std::atomic<bool>* const aborted_;

  // State of the current operation.
  const char* op_ = "";
  uint64_t seq_ = 0;
  Clock::time_point deadline_;
  Clock::time_point started_;
  bool in_callback_ = false;  // a completion callback of run() is running (Counts::forwards)
  int spin_us_ = 0;
  int busy_poll_ns_ = 0;
  int spin_skip_ = 0;     // waits left that sleep without spinning first
  int spin_backoff_ = 0;  // spin_skip_ after the next spin that runs out
  int busy_skip_ = 0;     // spins left that yield from their start (no busy poll)
  int busy_backoff_ = 0;  // busy_skip_ after the next busy poll that runs out
  bool wait_alone_ = true;
  Counts counts_;
  std::vector<Queue> sends_;
  std::vector<Queue> recvs_;
  std::vector<iovec> iov_;
  std::vector<char> bounce_;  // TCP recv_reduce staging
  size_t bounce_left_ = 0;    // bytes of a partial element at the start of bounce_
  std::vector<::pollfd> pollfds_;
  std::vector<int> poll_peers_;  // the peer of each pollfds_ entry
};

}  // namespace tdist::comm::detail
