#pragma once
// What the collective algorithms of the ring backend share (one algorithm per file, each with
// its header in this folder, Gloo's layout). Each runs on the group's worker thread over an
// Exchange (engine/exchange.h) on contiguous raw buffers; the process group (ring/) validates
// arguments, makes buffers contiguous and picks the algorithm.
//
// Every algorithm moves the same bytes in the same order on every rank for the same call, so
// the collective channel of a pair is a plain byte stream with no per-message header (except
// alltoall, whose sizes are per pair; see alltoall_pairwise.cpp).
//
// Layers of comm, top down (no folder includes one above it): the API (process_group.h, work.h,
// types.h), the dispatch and the factory; the backends ring/ and nccl/; algorithms/; engine/
// (exchange, point-to-point, reduction kernels, fingerprints); transport/.
#include <c10/core/ScalarType.h>
#include <sys/types.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "tdist/comm/engine/exchange.h"
#include "tdist/comm/engine/reduce_kernels.h"
#include "tdist/comm/types.h"

namespace tdist::comm::algorithms {

class Staging;  // Note [Overlapped staging] in overlapped_staging.h

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

// A byte range [begin, end) of a buffer.
struct ByteRange {
  size_t begin;
  size_t end;
};

}  // namespace tdist::comm::algorithms
