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
#include <chrono>
#include <cstdint>
#include <thread>

#include "tdist/comm/algorithms/allreduce_ring.h"
#include "tdist/comm/algorithms/overlapped_staging.h"
#include "tdist/core/error.h"

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

std::vector<ByteRange> ring_allreduce_pieces(size_t count, size_t elem, int size, int rank,
                                             size_t piece_bytes) {
  const size_t step = std::max<size_t>(1, piece_bytes / elem) * elem;
  std::vector<ByteRange> out;
  for (int s = 0; s < size; ++s) {
    const int g = ((rank - s) % size + size) % size;
    const size_t end = ring_segment_begin(count, g + 1, size) * elem;
    for (size_t b = ring_segment_begin(count, g, size) * elem; b < end; b += step) {
      out.push_back(ByteRange{b, std::min(end, b + step)});
    }
  }
  return out;
}

void ring_phases(Context& c, const RingView& ring, char* data, size_t count, const ReduceSpec& rs,
                 RingPhases phases, Staging* staging, int average_over) {
  const int n = ring.size;
  TDIST_CHECK(average_over == 0 || phases == RingPhases::kBoth, "averaging needs both phases");
  if (count == 0) return;
  if (n == 1) {
    if (average_over > 1) detail::divide_in_place(data, rs.dtype, count, average_over);
    return;
  }
  const int r = ring.me;
  const int right = ring.rank_at((r + 1) % n);
  const int left = ring.rank_at((r + n - 1) % n);
  const size_t es = rs.elem_size;
  const size_t chunk = chunk_elems(c, es);
  const int first = phases == RingPhases::kAllgather ? 1 : 0;
  const int end = phases == RingPhases::kReduceScatter ? 1 : 2;

  TDIST_CHECK(staging == nullptr || phases == RingPhases::kBoth, "staging needs both phases");
  // The first step sends this rank's own segment r (reduce-scatter) or the segment it reduced,
  // r + 1 (allgather); a staged segment goes piece by piece, each once it arrived.
  {
    const Cursor own{n, r, count, chunk, first, end};
    const int g = (r + first) % n;
    send_staged(c, right, data + own.seg_begin(g) * es, own.seg_len(g) * es, staging);
  }
  // Every incoming chunk, in stream order; the cookie is the index in that order.
  Cursor post{n, r, count, chunk, first, end};
  post.settle();
  for (uint64_t i = 0; !post.done(); ++i) {
    char* dst = data + (post.seg_begin(post.seg()) + post.off) * es;
    if (post.phase == 0) {
      // A staged chunk waits for the last piece holding it.
      c.ex.recv_reduce(left, dst, dst, post.len() * es, rs.fn, es, i,
                       gate_for(staging, dst, post.len() * es));
    } else {
      c.ex.recv(left, dst, post.len() * es, i);
    }
    post.advance();
  }
  Cursor done{n, r, count, chunk, first, end};
  done.settle();
  c.ex.run([&](int, uint64_t) {
    // Completions arrive in posting order, so `done` walks the same sequence. A chunk is
    // forwarded unless it completed the last step of the last phase run; it is final after the
    // last reduce-scatter step (an average's quotient is taken then, before it is sent on) and
    // in the allgather.
    char* dst = data + (done.seg_begin(done.seg()) + done.off) * es;
    if (average_over > 0 && done.phase == 0 && done.step == n - 2) {
      detail::divide_in_place(dst, rs.dtype, done.len(), average_over);
    }
    if (done.step < n - 2 || done.phase + 1 < end) c.ex.send(right, dst, done.len() * es);
    if (staging != nullptr && (done.phase == 1 || done.step == n - 2)) {
      const auto b = static_cast<size_t>(dst - data);
      staging->finished(b, b + done.len() * es);
    }
    done.advance();
  });
}

void allreduce_ring(Context& c, char* data, size_t count, const ReduceSpec& rs, Staging* staging) {
  TDIST_CHECK(staging == nullptr || c.size > 1, "a staged ring needs a peer");
  ring_phases(c, RingView{nullptr, c.size, c.rank}, data, count, rs, RingPhases::kBoth, staging,
              rs.op == ReduceOp::AVG ? c.size : 0);
}

}  // namespace tdist::comm::algorithms
