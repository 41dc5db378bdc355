// Pairwise alltoall: every pair of ranks exchanges its blocks directly, all pairs in flight at
// once on this rank's exchange. Because split sizes are chosen per rank, each block is preceded
// by its length (u64): a receiver whose expected size differs fails with an error naming both
// sizes instead of misreading the stream (the group is then aborted, as after any stream error).

#include <cstring>

#include "tdist/comm/algorithms/algorithms.h"
#include "tdist/core/error.h"

namespace tdist::comm::algorithms {

void alltoall_pairwise(Context& c, const std::vector<const char*>& send,
                       const std::vector<size_t>& send_bytes, const std::vector<char*>& recv,
                       const std::vector<size_t>& recv_bytes) {
  const int n = c.size;
  const int r = c.rank;
  if (send_bytes[r] > 0) std::memmove(recv[r], send[r], send_bytes[r]);
  if (n == 1) return;
  // Headers live in scratch: [0, n) outgoing lengths, [n, 2n) incoming ones.
  auto* hdr = reinterpret_cast<uint64_t*>(c.scratch.get(2 * static_cast<size_t>(n) * 8));
  // Pairs in the order r+1, r+2, ... spread the load instead of everyone hitting rank 0 first.
  for (int k = 1; k < n; ++k) {
    int p = (r + k) % n;
    hdr[p] = send_bytes[p];
    c.ex.send(p, &hdr[p], 8);
    c.ex.send(p, send[p], send_bytes[p]);
    int q = (r - k + n) % n;
    c.ex.recv(q, &hdr[n + q], 8, 1);
    c.ex.recv(q, recv[q], recv_bytes[q], 0);
  }
  c.ex.run([&](int peer, uint64_t is_header) {
    if (is_header != 0 && hdr[n + peer] != recv_bytes[peer]) {
      TDIST_THROW(InvalidArgument, c.ex.where(), ": rank ", peer, " sends ", hdr[n + peer],
                  " bytes but this rank expects ", recv_bytes[peer],
                  " bytes from it (the split sizes of the ranks do not match)");
    }
  });
}

}  // namespace tdist::comm::algorithms
