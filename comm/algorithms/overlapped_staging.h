#pragma once
// Staging for the algorithms: a buffer copied in piece by piece while the ring runs.
#include <cstddef>
#include <utility>
#include <vector>

#include "tdist/comm/algorithms/context.h"
#include "tdist/comm/engine/exchange.h"

namespace tdist::comm::algorithms {

// Note [Overlapped staging]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A CUDA tensor reaches the ring through host memory (Note [Staging device tensors] in
// ring/staging.h). Copying it all in, running the ring and copying it all back puts two full
// copies in sequence with the transfers; a large allreduce instead overlaps them. At issue the
// caller's thread queues one device-to-host copy per piece (1 MiB, or the group's
// TDIST_STAGING_PIECE_BYTES) on the caller's stream, in the order the ring reads them
// (ring_allreduce_pieces: this rank's own segment first, which it sends at once, then the
// segments in the order reduce-scatter reduces into them), each followed by an event. The ring
// posts everything as usual, but every transfer that reads the buffer carries a gate
// (detail::Gate) on the last piece it touches: the exchange moves no byte of it before that
// piece's event completed (pieces complete in order), and a wait held only by a copy sleeps
// briefly instead of until the next I/O. Every chunk whose values are final (the last
// reduce-scatter step, and each allgather receive) is handed to Staging::finished at once, which
// queues its host-to-device copy on a side stream while the rest of the ring runs; the Work
// completes after that stream drained, as before. Nothing about the byte stream changes (a send
// split at piece boundaries is the same bytes), so a staged rank, an unstaged CUDA rank and a CPU
// rank run one ring together. Memory is one pinned buffer per window (two at most at
// once: Note [Windows]), from the caching host allocator; a window copied in while an
// earlier one runs uses a side stream that first waits for the point the caller's stream had
// reached at issue. An average is divided chunk by chunk as each segment's sum completes
// (ring_phases' average_over), so its chunks are finished as a sum's are. allreduce_coalesced
// stages its tensors as one host buffer. The same pieces serve two more operations (tensor and
// list forms; a list is staged as one host buffer too), window by window: a reduce-scatter's
// input arrives in the order reduce_scatter_ring reads it (reduce_scatter_pieces), and its
// output's slice, behind the inputs' in the same buffer, is finished once reduced; an
// allgather's window copies in only this rank's slice, straight from its input into its own
// block (its sends, or for the single copy its address message, wait for it), and finishes
// every other block as it lands (from the ring or by single copy). A broadcast's root copies its
// window in by pieces and sends each as it arrives (the chain, or for the world-2 single copy its
// address message, waits for them), and the other ranks copy each chunk out as it lands; a
// reduce reads every rank's input as its pieces arrive, and the root copies each chunk out once
// reduced (an average divided first). A gather's root finishes each chunk of the other blocks as
// it lands and its own block once its pieces arrived; its senders send each piece as it arrives;
// a scatter the other way round; an alltoall the same for every pair. The copies out never start
// before the point the caller's stream had reached at issue, so no kernel queued before the
// operation sees its outputs change.

// A buffer that is being copied into host memory piece by piece, in the order given at
// construction, and out again as an algorithm finishes parts of it (Note [Overlapped staging]).
class Staging : public detail::Arrivals {
 public:
  // `base`: the host buffer; `order`: its pieces in arrival order (none for a buffer the
  // operation only writes).
  Staging(const char* base, std::vector<ByteRange> order);
  const std::vector<ByteRange>& order() const { return order_; }
  // The position in arrival order of the last piece that overlaps [begin, end) (pieces arrive in
  // order, so all of the range has arrived once that one has); kNoPiece if none does.
  static constexpr size_t kNoPiece = SIZE_MAX;
  size_t last_piece(size_t begin, size_t end) const;
  // Bytes [begin, end) of the buffer hold their final values and are no longer written.
  virtual void finished(size_t begin, size_t end) = 0;
  // The same for the n bytes at p, inside the buffer.
  void finished_at(const char* p, size_t n) {
    const auto b = static_cast<size_t>(p - base_);
    finished(b, b + n);
  }
  // The gate of a transfer that reads the n bytes at p: the last piece holding them (none for
  // bytes that no piece brings).
  detail::Gate gate_for(const char* p, size_t n) {
    const auto b = static_cast<size_t>(p - base_);
    const size_t last = last_piece(b, b + n);
    return last == kNoPiece ? detail::Gate{} : detail::Gate{-1, 0, this, last};
  }
  // Waits until bytes [begin, end) have arrived (a copy in, which no peer holds up).
  void await_arrival(size_t begin, size_t end);
  // Posts the n bytes at p to `peer` split at piece boundaries, each part gated on its piece, so
  // that the first parts leave before the last ones arrived (bytes outside the pieces ungated).
  void send(Context& c, int peer, const char* p, size_t n);

 private:
  const char* base_;
  std::vector<ByteRange> order_;
  std::vector<std::pair<size_t, size_t>> by_offset_;  // (begin, position in order_), ascending
};

// Receives into a staged buffer: recv_chunks posts the n bytes at p from `peer` chunk by chunk
// (the cookie is the chunk's offset); run_finishing_chunks runs the exchange, finishing each
// chunk received into recv[peer] (recv_bytes[peer] bytes in all) as it lands.
void recv_chunks(Context& c, int peer, char* p, size_t n);
void run_finishing_chunks(Context& c, const std::vector<char*>& recv,
                          const std::vector<size_t>& recv_bytes, Staging& staging);

// Staging::send and Staging::gate_for where there is staging; a plain send and no gate where
// `staging` is null.
inline void send_staged(Context& c, int peer, const char* p, size_t n, Staging* staging) {
  if (staging != nullptr) {
    staging->send(c, peer, p, n);
  } else {
    c.ex.send(peer, p, n);
  }
}
inline detail::Gate gate_for(Staging* staging, const char* p, size_t n) {
  return staging != nullptr ? staging->gate_for(p, n) : detail::Gate{};
}

}  // namespace tdist::comm::algorithms
