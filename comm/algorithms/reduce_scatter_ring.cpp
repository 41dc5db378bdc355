// Ring reduce-scatter, streamed in rounds of one chunk per block. Round k works on elements
// [k*chunk, (k+1)*chunk) of every block: at step s (0..n-2) rank r sends the partial of block
// (r-s-1) to its right neighbour and receives the partial of block (r-s-2) from its left one;
// the last step's block is r itself. Inputs are never written: each incoming partial is reduced
// with this rank's input as it arrives (recv_reduce) and forwarded at once; the last step
// reduces into the output.
//
// Note [Reduce-scatter slots]
//   Both directions carry positions i = k*(n-1) + s in order (the send at position i is what the
//   right neighbour receives at i). The partials of steps 0..n-3 live only until they are
//   forwarded (the send at i + 1), so they rotate through kSlots chunk-sized slots: scratch is
//   kSlots chunks whatever the world and tensor sizes. A receive into a slot is gated on the
//   slot's previous chunk having been sent on (Exchange::recv_reduce's gate). No deadlock with
//   any channel buffer size: the receive at i waits only for the right neighbour's receive at
//   some position <= i - 1 (kSlots >= 2), for the left neighbour's send at i (posted once its
//   receive at i - 1 completed) and for this rank's sends before i; by induction on i over all
//   ranks every receive completes. (Rounds matter: sending a whole block before the first
//   partial would need a block of buffering per rank.)
//   The gate counts the bytes sent to the right neighbour in the whole operation (Gate), so it
//   starts from what was posted to it before this call: a reduce-scatter larger than a window
//   runs one ring per window in one operation (Note [Windows]), and a gate counted from this
//   call's start would already be open in the second window, letting a receive overwrite a
//   partial that was not forwarded yet (wrong sums from the second window on; issue 40).

#include <algorithm>
#include <atomic>
#include <cstring>

#include "tdist/comm/algorithms/reduce_scatter_ring.h"
#include "tdist/comm/algorithms/overlapped_staging.h"

namespace tdist::comm::algorithms {
namespace {

// Partial results rotate through this many chunk-sized slots (double buffering: one slot is
// filled from the left while the other drains to the right).
constexpr size_t kSlots = 2;

std::atomic<size_t> peak_scratch{0};

char* scratch(Context& c, size_t bytes) {
  size_t seen = peak_scratch.load(std::memory_order_relaxed);
  while (bytes > seen && !peak_scratch.compare_exchange_weak(seen, bytes)) {}
  return c.scratch.get(bytes);
}

}  // namespace

size_t reduce_scatter_peak_scratch_bytes() { return peak_scratch.load(); }
void reset_reduce_scatter_peak_scratch_bytes() { peak_scratch.store(0); }

std::vector<ByteRange> reduce_scatter_pieces(size_t count, size_t elem, int size, int rank,
                                             size_t chunk_bytes, size_t piece_bytes) {
  std::vector<ByteRange> out;
  const size_t block = count * elem;
  auto add = [&](int b, size_t lo, size_t hi) {  // elements [lo, hi) of block b
    if (lo < hi) out.push_back(ByteRange{b * block + lo * elem, b * block + hi * elem});
  };
  const int own = (rank + size - 1) % size;  // what step 0 sends
  if (size == 2) {  // sent whole at once, then the block reduced into the output, in order
    const size_t per = std::max<size_t>(1, piece_bytes / elem);
    for (size_t lo = 0; lo < count; lo += per) add(own, lo, std::min(count, lo + per));
    for (size_t lo = 0; lo < count; lo += per) add(rank, lo, std::min(count, lo + per));
    return out;
  }
  const size_t chunk = chunk_elems(chunk_bytes, elem);
  const size_t per = chunk * std::max<size_t>(1, piece_bytes / (chunk * elem));  // whole rounds
  for (size_t lo = 0; lo < count; lo += per) {
    for (int s = 1; s <= size; ++s) add((rank - s + size) % size, lo, std::min(count, lo + per));
  }
  return out;
}

void reduce_scatter_ring(Context& c, const std::vector<const char*>& inputs, char* output,
                         size_t count, const ReduceSpec& rs, Staging* staging) {
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
  const size_t steps = static_cast<size_t>(n - 1);
  const size_t chunk = chunk_elems(c, es);
  const size_t rounds = (count + chunk - 1) / chunk;
  const size_t slot_bytes = std::min(chunk, count) * es;
  char* slots = n == 2 ? nullptr : scratch(c, kSlots * slot_bytes);
  const char* own = inputs[(r - 1 + n) % n];  // what step 0 sends
  auto off = [&](size_t k) { return k * chunk * es; };
  auto len = [&](size_t k) { return std::min(chunk, count - k * chunk) * es; };
  // Stream position i = k * steps + s (round k, step s) of both directions; slot chunk u =
  // k * (n - 2) + s for the steps that keep a partial (s < n - 2).
  auto slot = [&](size_t k, size_t s) {
    return slots + ((k * (steps - 1) + s) % kSlots) * slot_bytes;
  };
  // Bytes this operation has sent to `right` once the send at position i is out.
  const uint64_t sent_before = c.ex.posted_to(right);
  auto sent_through = [&](size_t i) {
    const size_t k = i / steps;
    return sent_before + k * steps * chunk * es + (i % steps + 1) * len(k);
  };

  // A send or a reduction reading staged input waits for the last piece holding it.
  send_staged(c, right, own, n == 2 ? bytes : len(0), staging);
  for (size_t k = 0; k < rounds; ++k) {
    for (size_t s = 0; s < steps; ++s) {
      const int block = ((r - static_cast<int>(s) - 2) % n + 2 * n) % n;
      const char* other = inputs[block] + off(k);
      const uint64_t i = k * steps + s;
      detail::Gate gate = gate_for(staging, other, len(k));
      if (s + 1 == steps) {
        c.ex.recv_reduce(left, output + off(k), other, len(k), rs.fn, es, i, gate);
        continue;
      }
      // The slot's previous chunk (kSlots slot chunks back) must have been forwarded: that was
      // the send one position after its receive.
      const size_t u = k * (steps - 1) + s;
      if (u >= kSlots) {
        const size_t pk = (u - kSlots) / (steps - 1);
        const size_t ps = (u - kSlots) % (steps - 1);
        gate.peer = right;
        gate.sent = sent_through(pk * steps + ps + 1);
      }
      c.ex.recv_reduce(left, slot(k, s), other, len(k), rs.fn, es, i, gate);
    }
  }
  c.ex.run([&](int, uint64_t i) {
    const size_t k = i / steps;
    const size_t s = i % steps;
    if (s + 1 == steps) return;
    c.ex.send(right, slot(k, s), len(k));  // position i + 1
    // That was round k's last send: round k + 1 starts with this rank's own input.
    if (s + 2 == steps && k + 1 < rounds) {
      send_staged(c, right, own + off(k + 1), len(k + 1), staging);
    }
  });
  if (rs.op == ReduceOp::AVG) detail::divide_in_place(output, rs.dtype, count, n);
}

}  // namespace tdist::comm::algorithms
