// Ring allreduce: reduce-scatter then allgather, streamed.
//
// Note [Streaming ring]
//   Segment g = elements [count*g/n, count*(g+1)/n). At reduce-scatter step s (0..n-2) rank r
//   sends segment (r-s) to its right neighbour and receives segment (r-s-1) from its left one;
//   after n-1 steps it holds the full reduction of segment (r+1). At allgather step s it sends
//   segment (r+1-s) and receives segment (r-s). Both directions are one byte stream per
//   neighbour, so instead of stepping in lock-step every chunk of the whole sequence is posted
//   at once: a reduce-scatter chunk is reduced into the tensor as it arrives (recv_reduce: on
//   shared memory straight out of the ring, on TCP through a small bounce buffer) and, once
//   complete, posted to the right neighbour (it is what the next step sends); an allgather chunk
//   lands directly in the tensor and is forwarded unless it is the last step. Reduction of chunk
//   k thus overlaps the transfer of chunk k+1.
//   A send never reads memory that a later receive overwrites before the send completed: a
//   segment comes back to this rank only after the whole ring consumed what it sent, and the
//   reduce-scatter never writes segment r, the one sent first.

#include <algorithm>

#include "tdist/comm/algorithms/algorithms.h"

namespace tdist::comm::algorithms {
namespace {

struct Cursor {
  int n, r;
  size_t count, chunk;
  int phase;  // 0: reduce-scatter, 1: allgather
  int end;    // the phase after the last one this call runs
  int step = 0;
  size_t off = 0;  // elements into the segment

  int seg() const { return ((phase == 0 ? r - step - 1 : r - step) % n + 2 * n) % n; }
  size_t seg_begin(int g) const { return ring_segment_begin(count, g, n); }
  size_t seg_len(int g) const { return seg_begin(g + 1) - seg_begin(g); }
  size_t len() const { return std::min(chunk, seg_len(seg()) - off); }
  bool done() const { return phase >= end; }
  // Skips empty segments so that every position denotes a non-empty chunk.
  void settle() {
    while (phase < end && off >= seg_len(seg())) {
      off = 0;
      if (++step == n - 1) {
        step = 0;
        ++phase;
      }
    }
  }
  void advance() {
    off += len();
    settle();
  }
};

}  // namespace

void ring_phases(Context& c, const RingView& ring, char* data, size_t count, const ReduceSpec& rs,
                 RingPhases phases) {
  const int n = ring.size;
  if (n == 1 || count == 0) return;
  const int r = ring.me;
  const int right = ring.rank_at((r + 1) % n);
  const int left = ring.rank_at((r + n - 1) % n);
  const size_t es = rs.elem_size;
  const size_t chunk = chunk_elems(c, es);
  const int first = phases == RingPhases::kAllgather ? 1 : 0;
  const int end = phases == RingPhases::kReduceScatter ? 1 : 2;

  // The first step sends this rank's own segment r (reduce-scatter) or the segment it reduced,
  // r + 1 (allgather).
  {
    const Cursor own{n, r, count, chunk, first, end};
    const int g = (r + first) % n;
    c.ex.send(right, data + own.seg_begin(g) * es, own.seg_len(g) * es);
  }
  // Every incoming chunk, in stream order; the cookie is the index in that order.
  Cursor post{n, r, count, chunk, first, end};
  post.settle();
  for (uint64_t i = 0; !post.done(); ++i) {
    char* dst = data + (post.seg_begin(post.seg()) + post.off) * es;
    if (post.phase == 0) {
      c.ex.recv_reduce(left, dst, dst, post.len() * es, rs.fn, es, i);
    } else {
      c.ex.recv(left, dst, post.len() * es, i);
    }
    post.advance();
  }
  Cursor done{n, r, count, chunk, first, end};
  done.settle();
  c.ex.run([&](int, uint64_t) {
    // Completions arrive in posting order, so `done` walks the same sequence. A chunk is
    // forwarded unless it completed the last step of the last phase run.
    char* dst = data + (done.seg_begin(done.seg()) + done.off) * es;
    if (done.step < n - 2 || done.phase + 1 < end) c.ex.send(right, dst, done.len() * es);
    done.advance();
  });
}

void allreduce_ring(Context& c, char* data, size_t count, const ReduceSpec& rs) {
  ring_phases(c, RingView{nullptr, c.size, c.rank}, data, count, rs, RingPhases::kBoth);
  if (rs.op == ReduceOp::AVG && c.size > 1) detail::divide_in_place(data, rs.dtype, count, c.size);
}

}  // namespace tdist::comm::algorithms
