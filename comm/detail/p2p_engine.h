#pragma once
// P2PEngine: send / recv / recv_any_source of one group, on the group's point-to-point channel
// (a second connection per pair, so that messages never interleave with collective streams).
//
// Note [Point-to-point protocol]
//   Each message is a 16-byte header (u32 magic 'TDP2' | u32 tag | u64 payload bytes) followed by
//   the payload. Messages from one rank to another arrive in the order they were sent. The engine
//   reads a header as soon as it arrives and matches it against the posted receives in posting
//   order: the first one whose source is the sender (or any) and whose tag is equal. Until one is
//   posted the header is held and that connection is not read further (back-pressure; no buffer
//   is ever allocated for unexpected data). A receive whose size differs from the message fails
//   with an error naming both sizes and the payload is discarded (the stream stays in step).
//   Every operation has a deadline: one that passes before any byte moved fails that operation
//   alone; a timeout or a broken connection in the middle of a message leaves the stream unusable
//   and aborts the group (on_fatal).
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

  P2PEngine(std::vector<tcp::Connection*> peers, int rank,
            std::function<void(std::exception_ptr)> on_fatal);
  ~P2PEngine();  // stop()
  P2PEngine(const P2PEngine&) = delete;
  P2PEngine& operator=(const P2PEngine&) = delete;

  // `data` must stay valid until done runs. src = -1 receives from any rank.
  void send(const void* data, size_t bytes, int dst, uint32_t tag, Clock::time_point deadline,
            uint64_t seq, Done done);
  void recv(void* data, size_t bytes, int src, uint32_t tag, Clock::time_point deadline,
            uint64_t seq, Done done);

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
    uint8_t header[16];
    size_t moved = 0;  // header + payload bytes moved
  };
  struct PeerState {
    std::deque<std::unique_ptr<Op>> sends;
    uint8_t header[16];
    size_t header_got = 0;
    uint32_t tag = 0;
    uint64_t payload = 0;
    std::unique_ptr<Op> reading;  // matched receive whose payload is being read
    uint64_t discard = 0;         // payload bytes to drop (after a size mismatch)
    bool closed = false;
  };

  void loop();
  void post(std::unique_ptr<Op> op);
  void wake();
  bool progress_send(int peer);
  bool progress_read(int peer);
  bool try_match(int peer);
  void expire(Clock::time_point now);
  void complete(std::unique_ptr<Op> op, int source, std::exception_ptr error);
  void fatal(std::exception_ptr error);
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
  std::list<std::unique_ptr<Op>> recvs_;  // posted receives, in posting order
  std::vector<char> discard_buf_;
  std::thread thread_;
};

}  // namespace tdist::comm::detail
