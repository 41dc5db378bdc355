// Ring reduce-scatter, streamed like the first half of allreduce_ring (Note [Streaming ring]).
// At step s (0..n-2) rank r sends the partial of block (r-s-1) to its right neighbour and
// receives the partial of block (r-s-2) from its left one; the last step's block is r itself.
// Inputs are never written: each incoming partial is reduced with this rank's input into scratch
// as it arrives (recv_reduce) and forwarded at once; the last step reduces into the output.

#include <algorithm>
#include <atomic>
#include <cstring>

#include "tdist/comm/algorithms/algorithms.h"

namespace tdist::comm::algorithms {
namespace {

std::atomic<size_t> peak_scratch{0};

char* scratch(Context& c, size_t bytes) {
  size_t seen = peak_scratch.load(std::memory_order_relaxed);
  while (bytes > seen && !peak_scratch.compare_exchange_weak(seen, bytes)) {
  }
  return c.scratch.get(bytes);
}

}  // namespace

size_t reduce_scatter_peak_scratch_bytes() { return peak_scratch.load(); }
void reset_reduce_scatter_peak_scratch_bytes() { peak_scratch.store(0); }

void reduce_scatter_ring(Context& c, const std::vector<const char*>& inputs, char* output,
                         size_t count, const ReduceSpec& rs) {
  const int n = c.size;
  const int r = c.rank;
  const size_t es = rs.elem_size;
  const size_t bytes = count * es;
  if (count == 0) return;
  if (n == 1) {
    if (output != inputs[0]) std::memcpy(output, inputs[0], bytes);
    if (rs.op == ReduceOp::AVG) detail::divide_in_place(output, rs.dtype, count, n);
    return;
  }
  const int right = (r + 1) % n;
  const int left = (r + n - 1) % n;
  const size_t chunk = chunk_elems(c, es);
  const size_t chunks_per_block = (count + chunk - 1) / chunk;
  // Partials of steps 0..n-3 (the last step writes the output).
  char* partials = scratch(c, static_cast<size_t>(std::max(n - 2, 1)) * bytes);

  c.ex.send(right, inputs[(r - 1 + n) % n], bytes);
  for (int s = 0; s < n - 1; ++s) {
    const int block = ((r - s - 2) % n + 2 * n) % n;
    char* base = s < n - 2 ? partials + static_cast<size_t>(s) * bytes : output;
    for (size_t off = 0; off < count; off += chunk) {
      c.ex.recv_reduce(left, base + off * es, inputs[block] + off * es,
                       std::min(chunk, count - off) * es, rs.fn, es,
                       static_cast<uint64_t>(s) * chunks_per_block + off / chunk);
    }
  }
  c.ex.run([&](int, uint64_t cookie) {
    const int s = static_cast<int>(cookie / chunks_per_block);
    if (s == n - 2) return;
    const size_t off = (cookie % chunks_per_block) * chunk;
    c.ex.send(right, partials + static_cast<size_t>(s) * bytes + off * es,
              std::min(chunk, count - off) * es);
  });
  if (rs.op == ReduceOp::AVG) detail::divide_in_place(output, rs.dtype, count, n);
}

}  // namespace tdist::comm::algorithms
