// Recursive-doubling allreduce for small buffers.
//
// Note [Recursive doubling]
//   p = the largest power of two <= n, rem = n - p. Ranks below 2*rem pair up first: each even
//   one sends its buffer to the odd one above it, which reduces it in, and then sits out. The
//   p remaining ranks (new rank = r/2 below 2*rem, r-rem above) run log2(p) rounds; in round k a
//   rank exchanges its whole buffer with new rank ^ 2^k and reduces. Last, the odd ranks send
//   the result to their even partners. Each round reduces a op b on one side and b op a on the
//   other; the kernels are commutative (IEEE addition and multiplication are; MIN/MAX are made
//   so, Note [MIN/MAX semantics] in reduce_kernels.cpp), so every rank ends with bit-identical
//   results.

#include <cstring>

#include "tdist/comm/algorithms/allreduce_recursive_doubling.h"

namespace tdist::comm::algorithms {

void allreduce_recursive_doubling(Context& c, char* data, size_t count, const ReduceSpec& rs) {
  const int n = c.size;
  if (n == 1 || count == 0) return;
  const int r = c.rank;
  const size_t bytes = count * rs.elem_size;
  char* tmp = c.scratch.get(bytes);
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int rem = n - p;

  int newrank;
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      c.ex.send(r + 1, data, bytes);
      c.ex.recv(r + 1, data, bytes);  // the final result, after the rounds
      c.ex.run();
      newrank = -1;
    } else {
      c.ex.recv(r - 1, tmp, bytes);
      c.ex.run();
      rs.fn(data, data, tmp, count);
      newrank = r / 2;
    }
  } else {
    newrank = r - rem;
  }

  if (newrank >= 0) {
    for (int mask = 1; mask < p; mask <<= 1) {
      int partner_new = newrank ^ mask;
      int partner = partner_new < rem ? partner_new * 2 + 1 : partner_new + rem;
      c.ex.send(partner, data, bytes);
      c.ex.recv(partner, tmp, bytes);
      c.ex.run();  // the send has completed too, so `data` may be overwritten
      rs.fn(data, data, tmp, count);
    }
    if (r < 2 * rem) {
      c.ex.send(r - 1, data, bytes);
      c.ex.run();
    }
  }
  if (rs.op == ReduceOp::AVG) detail::divide_in_place(data, rs.dtype, count, n);
}

}  // namespace tdist::comm::algorithms
