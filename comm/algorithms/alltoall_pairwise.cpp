// Pairwise alltoall: every pair of ranks exchanges its blocks directly, all pairs in flight at
// once on this rank's exchange. Because split sizes are chosen per rank, each block is preceded
// by its length (u64): a receiver whose expected size differs fails with an error naming both
// sizes instead of misreading the stream (the group is then aborted, as after any stream error).

#include <cstring>

#include "tdist/comm/algorithms/alltoall_pairwise.h"
#include "tdist/comm/algorithms/overlapped_staging.h"
#include "tdist/core/error.h"

namespace tdist::comm::algorithms {
namespace {

constexpr uint64_t kHeader = UINT64_MAX;  // the cookie of a length's receive

// Posts this rank's lengths to every peer and the receives of theirs; headers live in scratch:
// [0, n) outgoing lengths, [n, 2n) incoming ones. With `send` and `recv`, each peer's block
// follows its length. Pairs in the order r+1, r+2, ... spread the load instead of everyone
// hitting rank 0 first.
uint64_t* post(Context& c, const std::vector<size_t>& send_bytes,
               const std::vector<size_t>& recv_bytes, const std::vector<const char*>* send,
               const std::vector<char*>* recv) {
  const int n = c.size;
  const int r = c.rank;
  auto* hdr = reinterpret_cast<uint64_t*>(c.scratch.get(2 * static_cast<size_t>(n) * 8));
  for (int k = 1; k < n; ++k) {
    const int p = (r + k) % n;
    hdr[p] = send_bytes[p];
    c.ex.send(p, &hdr[p], 8);
    if (send != nullptr) c.ex.send(p, (*send)[p], send_bytes[p]);
    const int q = (r - k + n) % n;
    c.ex.recv(q, &hdr[n + q], 8, kHeader);
    if (recv != nullptr) c.ex.recv(q, (*recv)[q], recv_bytes[q], 0);
  }
  return hdr;
}

void check_length(const Context& c, const uint64_t* hdr, int peer,
                  const std::vector<size_t>& recv_bytes) {
  if (hdr[c.size + peer] != recv_bytes[peer]) {
    TDIST_THROW(InvalidArgument, c.ex.where(), ": rank ", peer, " sends ", hdr[c.size + peer],
                " bytes but this rank expects ", recv_bytes[peer],
                " bytes from it (the split sizes of the ranks do not match)");
  }
}

}  // namespace

void alltoall_pairwise(Context& c, const std::vector<const char*>& send,
                       const std::vector<size_t>& send_bytes, const std::vector<char*>& recv,
                       const std::vector<size_t>& recv_bytes) {
  const int r = c.rank;
  if (send_bytes[r] > 0) std::memmove(recv[r], send[r], send_bytes[r]);
  if (c.size == 1) return;
  const uint64_t* hdr = post(c, send_bytes, recv_bytes, &send, &recv);
  c.ex.run([&](int peer, uint64_t cookie) {
    if (cookie == kHeader) check_length(c, hdr, peer, recv_bytes);
  });
}

void alltoall_lengths(Context& c, const std::vector<size_t>& send_bytes,
                      const std::vector<size_t>& recv_bytes) {
  if (c.size == 1) return;
  const uint64_t* hdr = post(c, send_bytes, recv_bytes, nullptr, nullptr);
  c.ex.run([&](int peer, uint64_t) { check_length(c, hdr, peer, recv_bytes); });
}

void alltoall_blocks(Context& c, const std::vector<const char*>& send,
                     const std::vector<size_t>& send_bytes, const std::vector<char*>& recv,
                     const std::vector<size_t>& recv_bytes, Staging& staging) {
  const int n = c.size;
  const int r = c.rank;
  for (int k = 1; k < n; ++k) {
    const int p = (r + k) % n;
    staging.send(c, p, send[p], send_bytes[p]);
    const int q = (r - k + n) % n;
    recv_chunks(c, q, recv[q], recv_bytes[q]);
  }
  run_finishing_chunks(c, recv, recv_bytes, staging);
}

}  // namespace tdist::comm::algorithms
