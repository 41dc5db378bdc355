// Ring allreduce: reduce-scatter then allgather, streamed.
//
// Note [Streaming ring]
//   Segment g = elements [count*g/n, count*(g+1)/n). At reduce-scatter step s (0..n-2) rank r
//   sends segment (r-s) to its right neighbour and receives segment (r-s-1) from its left one;
//   after n-1 steps it holds the full reduction of segment (r+1). At allgather step s it sends
//   segment (r+1-s) and receives segment (r-s). Both directions are one byte stream per
//   neighbour, so instead of stepping in lock-step we post receives chunk by chunk: when chunk k
//   of a reduce-scatter segment arrives (into one of kSlots scratch slots), it is reduced into
//   the tensor at once and that same tensor chunk is posted to the right neighbour (it is what
//   the next step sends); an allgather chunk lands directly in the tensor and is forwarded
//   unless it is the last step. Reduction of chunk k thus overlaps the transfer of chunk k+1,
//   and the receive side touches only kSlots * chunk bytes of scratch (cache resident).
//   A send never reads memory that a later receive overwrites before the send completed: a
//   segment comes back to this rank only after the whole ring consumed what it sent.

#include <algorithm>

#include "tdist/comm/algorithms/algorithms.h"

namespace tdist::comm::algorithms {
namespace {

constexpr size_t kSlots = 4;

struct Cursor {
  int n, r;
  size_t count, chunk;
  int phase = 0;  // 0: reduce-scatter, 1: allgather, 2: done
  int step = 0;
  size_t off = 0;  // elements into the segment

  int seg() const { return ((phase == 0 ? r - step - 1 : r - step) % n + 2 * n) % n; }
  size_t seg_begin(int g) const { return count * static_cast<size_t>(g) / static_cast<size_t>(n); }
  size_t seg_len(int g) const { return seg_begin(g + 1) - seg_begin(g); }
  size_t len() const { return std::min(chunk, seg_len(seg()) - off); }
  bool done() const { return phase == 2; }
  // Skips empty segments so that every position denotes a non-empty chunk.
  void settle() {
    while (phase < 2 && off >= seg_len(seg())) {
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

void allreduce_ring(Context& c, char* data, size_t count, const ReduceSpec& rs) {
  const int n = c.size;
  if (n == 1 || count == 0) return;
  const int r = c.rank;
  const int right = (r + 1) % n;
  const int left = (r + n - 1) % n;
  const size_t es = rs.elem_size;
  const size_t chunk = chunk_elems(c, es);
  char* slots = c.scratch.get(kSlots * chunk * es);

  Cursor post{n, r, count, chunk};
  Cursor done{n, r, count, chunk};
  post.settle();
  done.settle();
  size_t rs_posted = 0;       // reduce-scatter chunks posted so far
  size_t rs_outstanding = 0;  // posted and not yet reduced

  auto post_more = [&] {
    while (!post.done()) {
      if (post.phase == 0) {
        if (rs_outstanding == kSlots) return;
        char* slot = slots + (rs_posted % kSlots) * chunk * es;
        c.ex.recv(left, slot, post.len() * es);
        ++rs_posted;
        ++rs_outstanding;
      } else {
        c.ex.recv(left, data + (post.seg_begin(post.seg()) + post.off) * es, post.len() * es);
      }
      post.advance();
    }
  };

  // Reduce-scatter step 0 sends this rank's own segment r.
  {
    Cursor own{n, r, count, chunk};
    size_t b = own.seg_begin(r);
    c.ex.send(right, data + b * es, own.seg_len(r) * es);
  }
  post_more();
  size_t rs_done = 0;
  c.ex.run([&](int, uint64_t) {
    const int g = done.seg();
    char* dst = data + (done.seg_begin(g) + done.off) * es;
    const size_t len = done.len();
    if (done.phase == 0) {
      const char* slot = slots + (rs_done % kSlots) * chunk * es;
      rs.fn(dst, dst, slot, len);
      ++rs_done;
      --rs_outstanding;
      c.ex.send(right, dst, len * es);  // the next step's (or the allgather's first) send
    } else if (done.step < n - 2) {
      c.ex.send(right, dst, len * es);
    }
    done.advance();
    post_more();
  });
  if (rs.op == ReduceOp::AVG) detail::divide_in_place(data, rs.dtype, count, n);
}

}  // namespace tdist::comm::algorithms
