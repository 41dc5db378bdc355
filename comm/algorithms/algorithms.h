#pragma once
// Collective algorithms of the ring backend, one per file (Gloo's layout). Each runs on the
// group's worker thread over an Exchange (detail/exchange.h) on contiguous raw buffers; the
// process group validates arguments, makes buffers contiguous and picks the algorithm.
//
// Every algorithm moves the same bytes in the same order on every rank for the same call, so
// the collective channel of a pair is a plain byte stream with no per-message header (except
// alltoall, whose sizes are per pair; see alltoall_pairwise.cpp).

#include <c10/core/ScalarType.h>
#include <sys/types.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

#include "tdist/comm/detail/exchange.h"
#include "tdist/comm/detail/reduce_kernels.h"
#include "tdist/comm/types.h"

namespace tdist::comm::algorithms {

class Staging;  // Note [Overlapped staging]

// Reusable scratch memory of one group (grows, never shrinks; 64-byte aligned).
class Scratch {
 public:
  char* get(size_t bytes);

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> data_;
  size_t capacity_ = 0;
};

struct Context {
  detail::Exchange& ex;
  int rank;
  int size;
  size_t chunk_bytes;  // pipelining granularity (TDIST_CHUNK_BYTES)
  Scratch& scratch;
  // By rank: the process whose memory the single-copy algorithms read (Note [Single-copy
  // collectives]); null when the group does not use them.
  const std::vector<pid_t>* pids = nullptr;
  // A ring allreduce, an allgather and a reduce-scatter run as consecutive rings over windows of
  // at most this many bytes (Note [Windows]; TDIST_WINDOW_BYTES, agreed by the group).
  size_t window_bytes = SIZE_MAX;
};

// Note [Windows]
// ~~~~~~~~~~~~~~
// A ring allreduce of more than the group's window (64 MiB by default) runs as one ring per
// window of the buffer, one after the other, on every rank alike (the ranks agree on the window
// when the group is created: each window is its own byte stream). So do a broadcast and a
// reduce. An allgather and a reduce-scatter do the same over the same slice of every rank's
// block: the size blocks' slices of one window hold at most a window's bytes
// (block_window_bytes, block_window_elems), so an allgather whose outputs total more than a
// window, or a reduce-scatter whose input does, runs one allgather or reduce-scatter per slice
// (by ring or single copy, as its slice's size says).
// On CPU tensors that costs one start per window. It bounds what a staged CUDA tensor needs in
// host memory, whatever its size: two windows while it runs (the one moving and the next one's
// copies in), one while it waits in the queue (its first window copies in at issue)
// (RingProcessGroup::allreduce_staged, allgather_staged, reduce_scatter_staged,
// broadcast_staged, reduce_staged; a reduce-scatter's window holds its output's slice too:
// (size + 1) / size windows). A staged gather, scatter or alltoall moves the same slice of every
// block per window too (gather_or_scatter_staged, alltoall_staged: an alltoall's window holds
// the slices of every block sent and received), but only a staged rank windows them: each pair
// of ranks exchanges one byte stream per block, whose bytes are the same whole or in slices.
// A recursive-doubling allreduce of more than a window (only when TDIST_ALLREDUCE_ALGO asks for
// it: the automatic choice takes it for small buffers) runs one per window too, so its scratch
// is bounded as well; staged, each window is exchanged once all of it arrived.
// The hierarchical allreduce is not windowed: its phases meet at each window's end, which cost
// 6-7% at 256 MiB across two hosts (docs/perf-history.md, "Windows on CPU tensors"), so a
// staged one is still copied whole.
inline size_t window_elems(size_t window_bytes, size_t elem_size) {
  return std::max<size_t>(1, window_bytes / elem_size);
}
// f(begin, n) for the consecutive windows [begin, begin + n) of `count` units, `window` each (the
// last one shorter).
template <typename F>
void for_each_window(size_t count, size_t window, F&& f) {
  for (size_t begin = 0; begin < count; begin += window) f(begin, std::min(window, count - begin));
}
// Bytes of every rank's block in one allgather window: whole 4 KiB pages when a window holds one
// per rank, at least one byte.
inline size_t block_window_bytes(size_t window_bytes, int size) {
  const size_t b = window_bytes / static_cast<size_t>(size);
  return b >= 4096 ? b & ~size_t{4095} : std::max<size_t>(b, 1);
}
// Elements of every rank's block in one reduce-scatter window.
inline size_t block_window_elems(size_t window_bytes, int size, size_t elem_size) {
  return window_elems(window_bytes / static_cast<size_t>(size), elem_size);
}

struct ReduceSpec {
  c10::ScalarType dtype;
  size_t elem_size;
  ReduceOp op;
  detail::ReduceFn fn;
};

// Elements per pipelining chunk (at least 1).
inline size_t chunk_elems(size_t chunk_bytes, size_t elem_size) {
  size_t n = chunk_bytes / elem_size;
  return n == 0 ? 1 : n;
}
inline size_t chunk_elems(const Context& c, size_t elem_size) {
  return chunk_elems(c.chunk_bytes, elem_size);
}

// A ring over some of the group's ranks: position i is group rank ranks[i] (the group itself,
// ranks 0..size-1, when ranks is null); this rank is at position `me`.
struct RingView {
  const int* ranks;
  int size;
  int me;
  int rank_at(int pos) const { return ranks ? ranks[pos] : pos; }
};

// The ring allreduce's two phases over `ring` (Note [Streaming ring]), in place on `data` (count
// elements, split into ring.size segments: segment g = [count*g/size, count*(g+1)/size)).
// kReduceScatter leaves segment (me+1) % size fully reduced at position `me` (the rest is
// partial); kAllgather starts from that state and sends each position's segment to all.
// With `staging` (kBoth only) reads wait for the buffer's pieces and final chunks are finished.
// With `average_over` > 0 (kBoth only) the rank that completes a segment's sum divides each of
// its chunks by it before the allgather sends them, so every segment is divided once, by one
// rank, and every rank ends with the same quotient.
enum class RingPhases { kBoth, kReduceScatter, kAllgather };
void ring_phases(Context& c, const RingView& ring, char* data, size_t count, const ReduceSpec& rs,
                 RingPhases phases, Staging* staging = nullptr, int average_over = 0);
inline size_t ring_segment_begin(size_t count, int segment, int size) {
  return count * static_cast<size_t>(segment) / static_cast<size_t>(size);
}

// Note [Overlapped staging]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A CUDA tensor reaches the ring through host memory (Note [Staging device tensors] in
// detail/staging.h). Copying it all in, running the ring and copying it all back puts two full
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

// A byte range [begin, end) of a buffer.
struct ByteRange {
  size_t begin;
  size_t end;
};

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

// The pieces of a ring allreduce's buffer (count elements of elem bytes, world size, this rank) in
// the order it reads them: segment rank, rank - 1, ..., rank + 1, each cut into pieces of at most
// piece_bytes (whole elements).
std::vector<ByteRange> ring_allreduce_pieces(size_t count, size_t elem, int size, int rank,
                                             size_t piece_bytes);

// The pieces of a ring reduce-scatter's inputs (size blocks of count elements of elem bytes,
// block b at byte b * count * elem) in the order reduce_scatter_ring reads them with
// `chunk_bytes` chunks: round by round (as many rounds per piece as fit in piece_bytes), block
// rank - 1, rank - 2, ..., rank in each; at world 2 block rank + 1 whole first (it is sent at
// once).
std::vector<ByteRange> reduce_scatter_pieces(size_t count, size_t elem, int size, int rank,
                                             size_t chunk_bytes, size_t piece_bytes);

// In place on `data` (count elements). Bandwidth-optimal: reduce-scatter then allgather around
// the ring, chunked so that chunk k is reduced and forwarded while chunk k+1 is in flight.
// With `staging` (world size > 1) the buffer is still being copied in, in the order of
// ring_allreduce_pieces, and every part whose values are final is handed to it.
void allreduce_ring(Context& c, char* data, size_t count, const ReduceSpec& rs,
                    Staging* staging = nullptr);

// Ranks grouped by host (Note [Hierarchical allreduce]): every host has local.size() ranks.
struct Hierarchy {
  std::vector<int> local;  // this host's ranks, ascending
  std::vector<int> cross;  // the rank at this rank's local position on every host, by host
  int local_index = 0;     // this rank's position in `local`
  int host_index = 0;      // this host's position in `cross`
};
// In place: reduce-scatter inside each host, allreduce of each segment across hosts, allgather
// inside each host. Bit-identical results on every rank, like allreduce_ring.
void allreduce_hierarchical(Context& c, const Hierarchy& h, char* data, size_t count,
                            const ReduceSpec& rs);
// In place. Latency-optimal for small buffers: log2(n) exchanges of the whole buffer;
// non-powers of two fold the extra ranks in first and send them the result last.
void allreduce_recursive_doubling(Context& c, char* data, size_t count, const ReduceSpec& rs);

// `bytes` of `data` from root to every rank, along a chain, chunked and pipelined. With `staging`
// (its buffer holds `data`): the root's data is being copied in as its pieces, and what it sends
// waits for them; every other rank finishes each chunk as it lands.
void broadcast_pipelined(Context& c, char* data, size_t bytes, int root,
                         Staging* staging = nullptr);

// Note [Single-copy collectives]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Through a shared-memory ring every byte is copied twice: by the sender into the ring and by
// the receiver out of it. When all of a group's ranks are distinct processes of one host that
// may read each other's memory (at set-up the kernel names each peer's process, never the peer
// itself, and ranks that are threads of one process are never read: Note [Shared-memory
// negotiation] in transport/channels.h, core/process_memory.h), a large allgather or broadcast
// copies
// each byte once instead: every rank tells the ranks that need its data where that data is
// (an 8-byte address over the collective channel), each of them copies it straight into its
// own output with process_vm_readv, and each then tells the owner it is done (one byte), so no
// rank returns (and lets its caller reuse the buffer) while a peer may still be reading it.
// The world-2 broadcast splits the copy: the root writes half into its peer (process_vm_writev,
// which the kernel allows exactly when it allows reading) while the peer reads the other half.
// The address message carries the size too: ranks that called the operation with different
// sizes all fail it (MismatchError; the group stays usable) before any memory is touched, so no
// rank ever writes past the end of a peer's buffer or reads past the end of a peer's data.
// No rank waits for another between the address and the done message: a rank whose peers are
// descheduled (four ranks on two cores) still copies at once, and the copies of all ranks run
// in parallel. Open MPI's shared-memory transport does the same (CMA).
// The group uses it when every rank allows it (TDIST_SINGLE_COPY, default on) and can read
// every peer: allgathers from world 3 with blocks of at least TDIST_SINGLE_COPY_BYTES (default
// 256 KiB) and world-2 broadcasts of at least as many bytes (RingProcessGroup::broadcast_bytes
// says why those). At set-up every rank sends every peer its threshold (the largest value, when
// disabled or a peer is unreadable) and the group takes the largest, so ranks with different
// settings still agree. A peer that dies mid-copy makes the read fail (ESRCH), an error that
// names the rank; a peer that stops is noticed at the done message's deadline.

// Broadcast by single copy between two ranks: the root writes the first half of `data` into
// the other rank's, which reads the second half (both cores copy at once). With `staging` as for
// broadcast_pipelined (the root's address leaves once its data arrived).
void broadcast_single_copy(Context& c, char* data, size_t bytes, int root,
                           Staging* staging = nullptr);
// Allgather by single copy: every rank reads blocks[i] from rank i's blocks[i]. With `staging`
// as for allgather_ring.
void allgather_single_copy(Context& c, const std::vector<char*>& blocks, size_t block_bytes,
                           Staging* staging = nullptr);

// Reduces every rank's `input` into `output` on root along a chain ending at root, chunked and
// pipelined. `output` is used on root only (it may alias `input`); non-root inputs are unchanged.
// With `staging` (world size > 1; the input is being copied in as its pieces, and on the root the
// output is the input) reads wait for the pieces and the root finishes each chunk once reduced.
void reduce_chain(Context& c, const char* input, char* output, size_t count, const ReduceSpec& rs,
                  int root, Staging* staging = nullptr);

// blocks[i] (block_bytes each) receives rank i's block; blocks[rank] holds this rank's, or, with
// `staging` (the blocks lie in its buffer), is being copied in as its pieces: what leaves it
// waits for them. With `staging` every received part is finished as it lands (this rank's own
// block is the caller's to finish).
void allgather_ring(Context& c, const std::vector<char*>& blocks, size_t block_bytes,
                    Staging* staging = nullptr);

// Root: blocks[i] receives rank i's `input` (blocks[root] is filled by the caller). With
// `staging` (its buffer holds the input, or on the root the blocks): what a rank sends waits for
// its pieces, and the root finishes every other block chunk by chunk as it lands (its own is the
// caller's to finish).
void gather_direct(Context& c, const char* input, const std::vector<char*>& blocks,
                   size_t block_bytes, int root, Staging* staging = nullptr);
// Root sends blocks[i] to rank i; every non-root receives into `output`. With `staging` as for
// gather_direct, the other way round: the root's sends wait for the blocks' pieces, every
// non-root finishes its output chunk by chunk.
void scatter_direct(Context& c, const std::vector<const char*>& blocks, char* output,
                    size_t block_bytes, int root, Staging* staging = nullptr);

// output = reduction over ranks of inputs[rank] (count elements per block), around the ring.
// With `staging` (world size > 1; the inputs lie in its buffer, in the order of
// reduce_scatter_pieces) reads wait for the inputs' pieces.
void reduce_scatter_ring(Context& c, const std::vector<const char*>& inputs, char* output,
                         size_t count, const ReduceSpec& rs, Staging* staging = nullptr);

// For tests: the largest scratch request (bytes) reduce_scatter_ring made in this process since
// the last reset (every group and rank together).
size_t reduce_scatter_peak_scratch_bytes();
void reset_reduce_scatter_peak_scratch_bytes();

// Sends send[i] (send_bytes[i]) to rank i and receives recv[i] (recv_bytes[i]) from it; the
// entries for this rank are copied locally.
void alltoall_pairwise(Context& c, const std::vector<const char*>& send,
                       const std::vector<size_t>& send_bytes, const std::vector<char*>& recv,
                       const std::vector<size_t>& recv_bytes);
// The same in parts, as a staged alltoall runs it window by window (the pairs' byte streams are
// the same): alltoall_lengths exchanges and checks the lengths of the whole blocks, then each
// alltoall_blocks moves a slice of every block, its sends waiting for the slices' pieces of
// `staging` and every received chunk finished as it lands. This rank's own block is the
// caller's.
void alltoall_lengths(Context& c, const std::vector<size_t>& send_bytes,
                      const std::vector<size_t>& recv_bytes);
void alltoall_blocks(Context& c, const std::vector<const char*>& send,
                     const std::vector<size_t>& send_bytes, const std::vector<char*>& recv,
                     const std::vector<size_t>& recv_bytes, Staging& staging);

// ceil(log2(n)) rounds of one byte each.
void barrier_dissemination(Context& c);

}  // namespace tdist::comm::algorithms
