#pragma once
// P2PEngine: send / recv / recv_any_source of one group, on the group's point-to-point channel
// (a second connection per pair, so that messages never interleave with collective streams).
//
// Note [Point-to-point protocol]
//   Receives are matched per (source, tag), as in Gloo: a receive never waits behind a message of
//   another tag. Every frame starts with a 32-byte header (u32 magic 'TDP3' | u32 kind | u32 tag |
//   u32 zero | u64 payload bytes | u64 message id). Kinds:
//     EAGER   a whole message (header + payload), for payloads up to kEagerMax bytes when the
//             sender holds that much credit from the receiver;
//     RTS     "ready to send" message `id` of `bytes` (larger messages, or no credit left);
//     CTS     the receiver's "clear to send" for `id`, once a matching receive is posted;
//     DATA    the payload of `id`, only after its CTS;
//     CREDIT  the receiver returns `bytes` of eager credit (the buffer they used is free);
//     CANCEL  the sender gave up on `id` (its send timed out before the CTS came).
//   Each rank starts with kEagerCredit bytes of credit toward every peer; an eager message costs
//   its payload and its 32-byte header (so empty messages count too), and CREDIT returns that
//   cost. A sender keeps at most kMaxAnnounced messages announced (RTS) and not yet cleared
//   (CTS) or cancelled per peer; later sends to that peer wait on the sender's side, in order.
//   A receiver therefore holds at most kEagerCredit bytes of eager messages and kMaxAnnounced
//   unmatched announcements per peer, and it enforces both: a peer that exceeds either broke the
//   protocol, and its pair alone fails (its connection is shut down; the operations that need
//   it fail with an error naming it and what it did; the rest of the group goes on). Every
//   other frame is a header, and the engine always reads every connection (no head-of-line
//   blocking between tags).
//   Matching: a message (EAGER or RTS, in arrival order) goes to the first posted receive whose
//   source is the sender or any and whose tag is equal; a receive posted later takes the first
//   matching unexpected message in arrival order. Messages of one (source, tag) therefore match
//   receives in the order they were sent. A send completes once its bytes are written: at once
//   for EAGER, after the receiver posted a matching receive otherwise.
//   A receive whose size differs from the message fails with an error naming both sizes and
//   the payload is discarded (the sender's send succeeds). Every operation has a deadline: one
//   that passes before any of its payload moved fails that operation alone (an expired RTS is
//   cancelled, an expired bound receive drops the payload when it comes); a timeout or a broken
//   connection in the middle of a frame leaves the stream unusable and aborts the group
//   (on_fatal).
//
// Note [Losing a peer]
//   A peer that finished and destroyed its group may close its connection while this rank
//   still has bytes of it to read: its last eager messages complete once written. A close with
//   bytes of ours unread (credit we returned) resets the connection, and our next write to it
//   fails while its last messages may still wait in our socket. So a failed write only stops
//   writing to that peer: the engine reads on until the stream ends (end of file or the reset,
//   which the kernel reports after the queued bytes), delivering every whole message, and only
//   then closes the pair (lost_peer). Its queued frames fail then, with the write's cause.
//
// Note [Streamed payloads]
//   A send or receive may give a Payload instead of a buffer: its bytes pass through memory the
//   payload lends piece by piece (a CUDA tensor staged through host memory window by window,
//   StagedMessage). Such a message always goes RTS/CTS/DATA, whatever its size, and is one DATA
//   frame on the wire like any other, so the peer need not know. Sending, the engine writes the
//   bytes the payload says are ready; while none are (a copy in has not arrived), it stops writing
//   to that peer and wakes every kStalledWaitNs to ask again (no descriptor signals a copy).
//   Receiving, the payload always has room for the next bytes (it may block until a copy out
//   frees a window; a copy always finishes). Both are told how far the bytes moved.
//
// Thread safety: send/recv/abort may be called from any thread; one internal thread does all
// socket I/O (poll-based) and runs completion callbacks.

#include <ATen/core/Tensor.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "tdist/comm/transport/tcp/connection.h"

namespace tdist::comm::detail {

class P2PEngine {
 public:
  // done(source_rank, error): error is null on success.
  using Done = std::function<void(int, std::exception_ptr)>;
  using Clock = std::chrono::steady_clock;

  // A message's bytes in memory lent piece by piece (Note [Streamed payloads]); called on the
  // engine thread only. An exception thrown by either aborts the group (the frame is midway).
  class Payload {
   public:
    virtual ~Payload() = default;
    // The bytes from `offset` on at *at: a send's that may be written now (0: none yet), a
    // receive's room (at least one byte while offset is short of the message's size).
    virtual size_t span(size_t offset, char** at) = 0;
    // Bytes [0, end) were written (a send) or have landed (a receive).
    virtual void moved(size_t end) = 0;
  };
  static constexpr long kStalledWaitNs = 20000;

  P2PEngine(std::vector<tcp::Connection*> peers, int rank,
            std::function<void(std::exception_ptr)> on_fatal);
  ~P2PEngine();  // stop()
  P2PEngine(const P2PEngine&) = delete;
  P2PEngine& operator=(const P2PEngine&) = delete;

  // Per-peer limits (Note [Point-to-point protocol]).
  static constexpr uint64_t kEagerMax = 64 * 1024;
  static constexpr uint64_t kEagerCredit = 256 * 1024;
  static constexpr uint64_t kMaxAnnounced = 1024;  // RTS not yet cleared, per peer

  // `data` must stay valid until done runs. src = -1 receives from any rank.
  void send(const void* data, size_t bytes, int dst, uint32_t tag, Clock::time_point deadline,
            uint64_t seq, Done done);
  void recv(void* data, size_t bytes, int src, uint32_t tag, Clock::time_point deadline,
            uint64_t seq, Done done);
  // The same through a payload (Note [Streamed payloads]), which must live until done runs.
  void send(std::shared_ptr<Payload> payload, size_t bytes, int dst, uint32_t tag,
            Clock::time_point deadline, uint64_t seq, Done done);
  void recv(std::shared_ptr<Payload> payload, size_t bytes, int src, uint32_t tag,
            Clock::time_point deadline, uint64_t seq, Done done);

  // Fails every pending and later operation with `error`. Never blocks on I/O.
  void abort(std::exception_ptr error);
  // Fails what is pending and joins the engine thread (after it, on_fatal is never called).
  // Idempotent.
  void stop();

 private:
  struct Op {
    char* data;
    size_t bytes;
    int peer;  // -1: any source
    uint32_t tag;
    Clock::time_point deadline;
    uint64_t seq;
    Done done;
    bool is_send;
    std::shared_ptr<Payload> payload = nullptr;  // instead of data (Note [Streamed payloads])
  };
  // A frame queued for writing; `op` (a send) completes when the frame is written.
  struct OutFrame {
    uint8_t header[32];
    const char* data = nullptr;
    uint64_t bytes = 0;  // payload bytes
    size_t moved = 0;    // header + payload bytes written
    std::unique_ptr<Op> op;
    uint64_t id = 0;
    bool eager = false;
    Payload* payload = nullptr;  // the op's, for a DATA frame of a streamed send
  };
  // A message that arrived before a matching receive was posted.
  struct Unexpected {
    int peer;
    uint32_t tag;
    uint64_t bytes;
    uint64_t id;  // RTS: the message to ask for
    bool eager;   // EAGER: `data` holds the payload
    std::vector<char> data;
  };
  struct PeerState {
    // Writing.
    std::deque<OutFrame> out;
    uint64_t credit = 0;  // eager credit this rank may still spend on the peer
    uint64_t next_id = 0;
    std::map<uint64_t, std::unique_ptr<Op>> awaiting_cts;  // RTS sent, by id
    std::deque<std::unique_ptr<Op>> held;  // sends that wait for room under kMaxAnnounced
    bool stalled = false;  // the next bytes to write are a payload's that are not ready
    // Reading: the current frame.
    uint8_t header[32];
    size_t header_got = 0;
    uint32_t kind = 0, tag = 0;
    uint64_t bytes = 0, id = 0;
    char* target = nullptr;  // where the payload goes (null: discard)
    uint64_t payload_got = 0;
    std::unique_ptr<Op> reading;               // the receive the payload completes (if any)
    std::unique_ptr<std::vector<char>> stash;  // an unexpected EAGER payload being read
    std::exception_ptr reading_error;          // completes `reading` with this (size mismatch)
    // Receives that sent a CTS and wait for the DATA, by id (null: drop the payload).
    std::map<uint64_t, std::unique_ptr<Op>> bound;
    // What this rank holds of the peer's limits: eager credit not yet returned, and the peer's
    // announcements in unexpected_.
    uint64_t eager_held = 0;
    uint64_t announced = 0;
    bool closed = false;
    // A write to the peer failed (Note [Losing a peer]): nothing more is written; reading goes
    // on until the stream ends, then the pair closes with this cause.
    std::string write_failed;
  };

  void loop();
  void post(std::unique_ptr<Op> op);
  void wake();
  void start_send(std::unique_ptr<Op> op);
  bool try_send(int peer, std::unique_ptr<Op>& op);
  void release_held(int peer);
  void start_recv(std::unique_ptr<Op> op);
  void queue_control(int peer, uint32_t kind, uint32_t tag, uint64_t bytes, uint64_t id);
  void return_credit(int peer, uint64_t bytes);
  bool progress_send(int peer);
  bool progress_read(int peer);
  void on_header(int peer);
  void on_payload_done(int peer);
  std::unique_ptr<Op> take_posted(int peer, uint32_t tag);
  void deliver(int peer, std::unique_ptr<Op> op, bool eager, uint64_t bytes, uint64_t id,
               std::vector<char>* data);
  void deliver_mismatch(int peer, std::unique_ptr<Op> op);
  void lost_peer(int peer, const std::string& cause);
  void broke_protocol(int peer, const std::string& what);
  void close_pair(int peer, const std::function<std::exception_ptr(const Op&)>& error);
  void expire(Clock::time_point now);
  Clock::time_point next_deadline() const;
  void complete(std::unique_ptr<Op> op, int source, std::exception_ptr error);
  void fatal(std::exception_ptr error);
  void fail_all(std::exception_ptr error);
  std::string where(const Op& op) const;

  // Constant after construction.
  const std::vector<tcp::Connection*> peers_;
  const int rank_;
  const std::function<void(std::exception_ptr)> on_fatal_;
  int wake_fd_ = -1;

  std::mutex mu_;
  std::vector<std::unique_ptr<Op>> incoming_;  // guarded by mu_: posted, not yet seen by loop()
  std::exception_ptr aborted_;                 // guarded by mu_
  bool stop_ = false;                          // guarded by mu_

  // Owned by the engine thread.
  std::vector<PeerState> state_;
  std::list<std::unique_ptr<Op>> recvs_;  // posted, unmatched receives, in posting order
  std::list<Unexpected> unexpected_;      // unmatched messages, in arrival order
  std::vector<char> discard_buf_;
  bool failed_ = false;  // fatal() ran: no more I/O
  std::thread thread_;
};

}  // namespace tdist::comm::detail
