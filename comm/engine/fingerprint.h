#pragma once
// Fingerprint: what a collective call looks like on one rank (operation, sequence number, dtype,
// reduce op, root and the shapes that must agree), compared across ranks before the collective
// runs when TDIST_DEBUG=DETAIL (c10d's collective fingerprint check).
//
// Note [Fingerprint check]
//   Before the operation's own bytes, every rank sends its encoded fingerprint (u64 length, then
//   the bytes) to every other rank on the collective channel and receives all of theirs, so the
//   streams stay in step whatever the outcome. Every rank then compares every fingerprint with
//   rank 0's; on a mismatch all ranks fail the operation with the same error, naming the ranks
//   that differ and each differing field, and the group stays usable (nothing else was sent).
//
// Thread safety: a value type.

#include <cstdint>
#include <string>
#include <vector>

#include "tdist/comm/engine/exchange.h"
#include "tdist/core/error.h"
#include "tdist/core/store.h"

namespace tdist::comm::detail {

struct Fingerprint {
  std::string op;
  uint64_t seq = 0;
  int32_t dtype = -1;  // c10::ScalarType, -1 when the operation has no tensor
  int32_t redop = -1;  // ReduceOp, -1 when none
  int32_t root = -1;   // -1 when none
  std::vector<std::vector<int64_t>> shapes;

  Bytes encode() const;
  // Bounded decoding (ProtocolError on malformed bytes).
  static Fingerprint decode(const Bytes& bytes);
  // "" when equal, otherwise "op allreduce vs broadcast, shapes [[4]] vs [[5]]".
  std::string difference(const Fingerprint& other) const;
};

// Exchanges fingerprints over `ex` (its operation already begun) and throws MismatchError when
// any rank's fingerprint differs from rank 0's.
void check_fingerprints(Exchange& ex, const Fingerprint& mine);

// Thrown by check_fingerprints: the operation fails, the group is not aborted.
class MismatchError : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

}  // namespace tdist::comm::detail
