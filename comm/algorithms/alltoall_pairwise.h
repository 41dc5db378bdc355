#pragma once
// Pairwise alltoall.
#include <cstddef>
#include <vector>

#include "tdist/comm/algorithms/context.h"

namespace tdist::comm::algorithms {

// Sends send[i] (send_bytes[i]) to rank i and receives recv[i] (recv_bytes[i]) from it; the
// entries for this rank are copied locally.
void alltoall_pairwise(Context& c, const std::vector<const char*>& send,
                       const std::vector<size_t>& send_bytes, const std::vector<char*>& recv,
                       const std::vector<size_t>& recv_bytes);
// The same in parts, as a staged alltoall runs it window by window (the pairs' byte streams are
// the same): alltoall_lengths exchanges and checks the lengths of the whole blocks, then each
// alltoall_blocks moves a slice of every block, its sends waiting for the slices' pieces of
// `staging` and every received chunk finished as it lands. This rank's own block is the
// caller's.
void alltoall_lengths(Context& c, const std::vector<size_t>& send_bytes,
                      const std::vector<size_t>& recv_bytes);
void alltoall_blocks(Context& c, const std::vector<const char*>& send,
                     const std::vector<size_t>& send_bytes, const std::vector<char*>& recv,
                     const std::vector<size_t>& recv_bytes, Staging& staging);

}  // namespace tdist::comm::algorithms
