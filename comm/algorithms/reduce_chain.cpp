// Pipelined reduce along the chain root+1, root+2, ..., root: the first rank sends its input;
// every later rank reduces the incoming partial result with its own input as it arrives
// (recv_reduce) and forwards each chunk at once; the root reduces the last partial into its
// output. Non-root inputs are never written (partials live in scratch).

#include <algorithm>
#include <cstring>

#include "tdist/comm/algorithms/reduce_chain.h"
#include "tdist/comm/algorithms/overlapped_staging.h"
#include "tdist/core/error.h"

namespace tdist::comm::algorithms {

void reduce_chain(Context& c, const char* input, char* output, size_t count, const ReduceSpec& rs,
                  int root, Staging* staging) {
  const int n = c.size;
  const size_t es = rs.elem_size;
  const size_t bytes = count * es;
  TDIST_CHECK(staging == nullptr || c.rank != root || output == input, c.ex.where(),
              ": a staged reduce runs in place on the root");
  if (c.rank == root && output != input && bytes > 0) std::memcpy(output, input, bytes);
  if (n > 1 && count > 0) {
    const int pos = (c.rank - root - 1 + 2 * n) % n;
    const int prev = (c.rank + n - 1) % n;
    const int next = (c.rank + 1) % n;
    if (pos == 0) {
      send_staged(c, next, input, bytes, staging);
      c.ex.run();
    } else {
      const bool is_root = c.rank == root;
      // Partials live in scratch on intermediate ranks (their input stays untouched).
      char* dst = is_root ? output : c.scratch.get(bytes);
      const char* other = is_root ? output : input;
      const size_t chunk = chunk_elems(c, es);
      for (size_t off = 0; off < count; off += chunk) {
        const size_t len = std::min(chunk, count - off) * es;
        c.ex.recv_reduce(prev, dst + off * es, other + off * es, len, rs.fn, es, off,
                         gate_for(staging, other + off * es, len));
      }
      c.ex.run([&](int, uint64_t off) {
        const size_t len = std::min(chunk, count - off);
        if (!is_root) {
          c.ex.send(next, dst + off * es, len * es);
        } else if (staging != nullptr) {  // final: divide an average now, then copy it out
          if (rs.op == ReduceOp::AVG) {
            detail::divide_in_place(output + off * es, rs.dtype, len, n);
          }
          staging->finished_at(output + off * es, len * es);
        }
      });
    }
  }
  if (c.rank == root && rs.op == ReduceOp::AVG && count > 0 && (staging == nullptr || n == 1)) {
    detail::divide_in_place(output, rs.dtype, count, n);
  }
}

}  // namespace tdist::comm::algorithms
