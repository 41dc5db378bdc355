// Halving-doubling allreduce.
//
// Note [Halving-doubling]
//   p = the largest power of two <= n, rem = n - p; ranks below 2*rem fold in first as in
//   recursive doubling (Note [Recursive doubling]): each even one sends its whole buffer to the
//   odd one above it, which reduces it in, sits out the rest and gets the result back last. The
//   p remaining ranks (new rank = r/2 below 2*rem, r-rem above) cut the buffer into p blocks
//   (block b = elements [count*b/p, count*(b+1)/p)) and hold the range of all p blocks:
//     reduce-scatter, d = p/2, p/4, ..., 1: exchange with new rank ^ d; the rank whose bit d is
//       clear keeps the lower half of its range and sends the upper half, its partner the
//       opposite; each reduces what it received into the half it keeps. After log2 p steps new
//       rank k holds block k fully reduced (AVG: divided here, once, by the one rank).
//     allgather, d = 1, 2, ..., p/2: exchange with new rank ^ d, sending the range held and
//       receiving the partner's (the other half of the range twice as large), copied in.
//   Per rank on the p ranks: (p-1)/p of the buffer sent and received in each phase, the ring's
//   bytes, in 2 log2 p rounds where the ring makes 2(n-1) dependent hops: the count that grows
//   with the world is the hops, each a hand-off that may wake a sleeping rank (docs/perf.md,
//   "Scaling with the world"), so at world 8 this is 6 rounds against 14 hops. Each block is
//   reduced by exactly one rank and then copied everywhere, so every rank ends bit-identical.
//   Within a step the send and the receive touch disjoint ranges, and a step starts after the
//   one before completed, so no send reads memory that a receive of the same step writes.

#include "tdist/comm/algorithms/allreduce_halving_doubling.h"

#include <algorithm>

namespace tdist::comm::algorithms {
namespace {

size_t block_begin(size_t count, int block, int p) {
  return count * static_cast<size_t>(block) / static_cast<size_t>(p);
}

}  // namespace

std::vector<HalvingDoublingStep> halving_doubling_plan(size_t count, int n, int r) {
  std::vector<HalvingDoublingStep> steps;
  if (n <= 1) return steps;
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int rem = n - p;
  if (r < 2 * rem && r % 2 == 0) {  // folds in, then gets the result
    steps.push_back({r + 1, 0, count, 0, 0, false});
    steps.push_back({r + 1, 0, 0, 0, count, false});
    return steps;
  }
  if (r < 2 * rem) steps.push_back({r - 1, 0, 0, 0, count, true});
  const int me = r < 2 * rem ? r / 2 : r - rem;
  const auto group_rank = [&](int newrank) {
    return newrank < rem ? newrank * 2 + 1 : newrank + rem;
  };
  int lo = 0, hi = p;  // the blocks held
  for (int d = p / 2; d >= 1; d /= 2) {
    const int mid = lo + (hi - lo) / 2;
    const bool lower = (me & d) == 0;
    const int keep_lo = lower ? lo : mid, keep_hi = lower ? mid : hi;
    const int give_lo = lower ? mid : lo, give_hi = lower ? hi : mid;
    const size_t kb = block_begin(count, keep_lo, p), gb = block_begin(count, give_lo, p);
    steps.push_back({group_rank(me ^ d), gb, block_begin(count, give_hi, p) - gb, kb,
                     block_begin(count, keep_hi, p) - kb, true});
    lo = keep_lo;
    hi = keep_hi;
  }
  for (int d = 1; d < p; d *= 2) {
    const bool lower = (me & d) == 0;
    const int width = hi - lo;
    const int other_lo = lower ? hi : lo - width, other_hi = other_lo + width;
    const size_t mb = block_begin(count, lo, p), ob = block_begin(count, other_lo, p);
    steps.push_back({group_rank(me ^ d), mb, block_begin(count, hi, p) - mb, ob,
                     block_begin(count, other_hi, p) - ob, false});
    lo = std::min(lo, other_lo);
    hi = std::max(hi, other_hi);
  }
  if (r < 2 * rem) steps.push_back({r - 1, 0, count, 0, 0, false});
  return steps;
}

void allreduce_halving_doubling(Context& c, char* data, size_t count, const ReduceSpec& rs) {
  const int n = c.size;
  if (n == 1 || count == 0) return;
  const size_t es = rs.elem_size;
  const auto steps = halving_doubling_plan(count, n, c.rank);
  int p = 1;
  while (p * 2 <= n) p *= 2;
  if (c.rank < 2 * (n - p) && c.rank % 2 == 0) {
    // Folds in: hands its buffer over and gets the result back, in one round (the partner's
    // result comes after everything it sent).
    c.ex.send(steps[0].peer, data, count * es);
    c.ex.recv(steps[1].peer, data, count * es);
    c.ex.run();
    return;
  }
  for (size_t i = 0; i < steps.size(); ++i) {
    const HalvingDoublingStep& s = steps[i];
    if (s.send_count == 0 && s.recv_count == 0) continue;  // empty blocks (count < p)
    c.ex.send(s.peer, data + s.send_begin * es, s.send_count * es);
    char* in = data + s.recv_begin * es;
    if (s.recv_count > 0) {
      if (s.reduce) {
        c.ex.recv_reduce(s.peer, in, in, s.recv_count * es, rs.fn, es);
      } else {
        c.ex.recv(s.peer, in, s.recv_count * es);
      }
    }
    c.ex.run();
    // The last reduce-scatter step completed this rank's block: divide it once, here.
    const bool last_reduce = s.reduce && (i + 1 == steps.size() || !steps[i + 1].reduce);
    if (rs.op == ReduceOp::AVG && last_reduce && s.recv_count > 0) {
      detail::divide_in_place(in, rs.dtype, s.recv_count, n);
    }
  }
}

}  // namespace tdist::comm::algorithms
