// Single-copy broadcast and allgather between the processes of one host (Note [Single-copy
// collectives] in single_copy.h).

#include <errno.h>

#include <algorithm>
#include <cstring>

#include "tdist/comm/algorithms/single_copy.h"
#include "tdist/comm/algorithms/overlapped_staging.h"
#include "tdist/comm/engine/fingerprint.h"
#include "tdist/core/error.h"
#include "tdist/core/process_memory.h"

namespace tdist::comm::algorithms {
namespace {

// The group runs these algorithms only when it knows every rank's process.
void check_peer_processes(const Context& c) {
  TDIST_CHECK(c.pids != nullptr && c.pids->size() == static_cast<size_t>(c.size), c.ex.where(),
              ": a single-copy algorithm in a group that does not use them");
}

// Copies `bytes` of `peer`'s memory at `address` into `out`; throws when the kernel could not.
void read_peer(Context& c, int peer, uint64_t address, char* out, size_t bytes) {
  check_peer_processes(c);
  const int err = try_read_process_memory((*c.pids)[peer], address, out, bytes);
  if (err == 0) return;
  if (err == ESRCH) {
    throw NetworkError(str(c.ex.where(), ": lost rank ", peer, ": its process is gone (reading ",
                           bytes, " bytes of its memory)"));
  }
  if (err == EFAULT) {
    // The peer announced this memory and keeps it until every rank is done, unless it failed
    // the operation first (another peer was lost) and its caller freed the buffer.
    throw NetworkError(str(c.ex.where(), ": lost rank ", peer,
                           ": it left the operation and freed the memory it announced (reading ",
                           bytes, " bytes of it: ", std::strerror(err), ")"));
  }
  throw NetworkError(str(c.ex.where(), ": reading ", bytes, " bytes of the memory of rank ", peer,
                         " failed: ", std::strerror(err)));
}

// Sends `bytes` at `data` (where and how many) to every peer and returns their addresses by
// rank. Every rank must announce the same size: when the ranks called the operation with
// different sizes, every rank sees at least one other size and fails the operation here with
// MismatchError, before any byte of anyone's memory is touched. All of them stop at the same
// point of the byte streams, so the group stays usable (as after a fingerprint mismatch). The
// address leaves once `gate` opens: no peer reads a staged block before it has arrived.
std::vector<uint64_t> exchange_addresses(Context& c, const char* data, size_t bytes,
                                         detail::Gate gate = {}) {
  const uint64_t mine[2] = {reinterpret_cast<uint64_t>(data), bytes};
  std::vector<uint64_t> theirs(2 * static_cast<size_t>(c.size));
  c.ex.swap_with_all(mine, theirs.data(), sizeof(mine), gate);
  std::vector<uint64_t> addresses(static_cast<size_t>(c.size));
  for (int p = 0; p < c.size; ++p) {
    if (p == c.rank) continue;
    if (theirs[2 * p + 1] != bytes) {
      throw detail::MismatchError(str(c.ex.where(), ": rank ", p, " called it with ",
                                      theirs[2 * p + 1], " bytes per rank, this rank with ",
                                      bytes));
    }
    addresses[p] = theirs[2 * p];
  }
  return addresses;
}

// One byte to every peer and one from each, dropped unread: every rank has passed this point.
void all_passed(Context& c) {
  static const char kToken = 1;
  for (int p = 0; p < c.size; ++p) {
    if (p == c.rank) continue;
    c.ex.send(p, &kToken, 1);
    c.ex.skip(p, 1);
  }
  c.ex.run();
}

}  // namespace

void broadcast_single_copy(Context& c, char* data, size_t bytes, int root, Staging* staging) {
  TDIST_CHECK(c.size == 2, c.ex.where(), ": the single-copy broadcast is for two ranks");
  if (bytes == 0) return;
  const std::vector<uint64_t> addresses =
      exchange_addresses(c, data, bytes, gate_for(staging, data, bytes));
  // The other rank reads it all; the root only keeps its buffer until then (Note [Single-copy
  // collectives]: no rank writes into another's memory).
  if (c.rank != root) read_peer(c, root, addresses[root], data, bytes);
  all_passed(c);
  if (c.rank != root && staging != nullptr) staging->finished_at(data, bytes);
}

void allgather_single_copy(Context& c, const std::vector<char*>& blocks, size_t block_bytes,
                           Staging* staging) {
  const int n = c.size;
  const int r = c.rank;
  if (n == 1 || block_bytes == 0) return;
  const std::vector<uint64_t> addresses =
      exchange_addresses(c, blocks[r], block_bytes, gate_for(staging, blocks[r], block_bytes));
  // Each rank starts with its right neighbour, so the ranks do not all read one rank at once.
  for (int s = 1; s < n; ++s) {
    const int p = (r + s) % n;
    read_peer(c, p, addresses[p], blocks[p], block_bytes);
    if (staging != nullptr) staging->finished_at(blocks[p], block_bytes);
  }
  all_passed(c);
}

namespace {

// Steps 2-5 of Note [Single-copy allreduce] on this rank's `data`: `fetch(p, offset, bytes, into)`
// gives `bytes` of rank p's buffer from `offset`, read into `into` (`scratch` while reducing, the
// segment's place in `data` while gathering) or where they lie.
template <class Fetch>
void reduce_segments_then_gather(Context& c, char* data, size_t count, const ReduceSpec& rs,
                                 char* scratch, Fetch&& fetch) {
  const int n = c.size;
  const int r = c.rank;
  const size_t es = rs.elem_size;
  // Segment s: elements [first(s), first(s + 1)).
  const size_t per = (count + static_cast<size_t>(n) - 1) / static_cast<size_t>(n);
  auto first = [&](int s) { return std::min(count, per * static_cast<size_t>(s)); };
  const size_t lo = first(r);
  const size_t len = first(r + 1) - lo;
  if (len > 0) {
    char* mine = data + lo * es;
    // Each rank starts with its right neighbour, so the ranks do not all read one rank at once.
    for (int s = 1; s < n; ++s) {
      rs.fn(mine, mine, fetch((r + s) % n, lo * es, len * es, scratch), len);
    }
    if (rs.op == ReduceOp::AVG) detail::divide_in_place(mine, rs.dtype, len, n);
  }
  all_passed(c);
  for (int s = 1; s < n; ++s) {
    const int p = (r + s) % n;
    const size_t plo = first(p);
    const size_t plen = first(p + 1) - plo;
    if (plen == 0) continue;
    char* into = data + plo * es;
    const char* got = fetch(p, plo * es, plen * es, into);
    if (got != into) std::memcpy(into, got, plen * es);
  }
  all_passed(c);
}

}  // namespace

void allreduce_single_copy(Context& c, char* data, size_t count, const ReduceSpec& rs) {
  const int n = c.size;
  if (n == 1 || count == 0) return;
  const size_t es = rs.elem_size;
  const std::vector<uint64_t> addresses = exchange_addresses(c, data, count * es);
  const size_t per = (count + static_cast<size_t>(n) - 1) / static_cast<size_t>(n);
  reduce_segments_then_gather(c, data, count, rs, c.scratch.get(per * es),
                              [&](int p, size_t offset, size_t bytes, char* into) {
                                read_peer(c, p, addresses[p] + offset, into, bytes);
                                return into;
                              });
}

void allreduce_mapped(Context& c, const std::vector<const char*>& buffers, size_t count,
                      const ReduceSpec& rs) {
  if (c.size == 1 || count == 0) return;
  reduce_segments_then_gather(
      c, const_cast<char*>(buffers[c.rank]), count, rs, nullptr,
      [&](int p, size_t offset, size_t, char*) { return buffers[p] + offset; });
}

void broadcast_mapped(Context& c, const std::vector<const char*>& buffers, size_t bytes, int root) {
  if (c.size == 1 || bytes == 0) return;
  if (c.rank != root) std::memcpy(const_cast<char*>(buffers[c.rank]), buffers[root], bytes);
  all_passed(c);
}

void allgather_mapped(Context& c, const std::vector<const char*>& sources,
                      const std::vector<char*>& blocks, size_t block_bytes) {
  const int n = c.size;
  if (n == 1 || block_bytes == 0) return;
  for (int s = 1; s < n; ++s) {
    const int p = (c.rank + s) % n;
    std::memcpy(blocks[p], sources[p], block_bytes);
  }
  all_passed(c);
}

void reduce_scatter_mapped(Context& c, const std::vector<const char*>& inputs, char* output,
                           size_t count, const ReduceSpec& rs) {
  const int n = c.size;
  const int r = c.rank;
  if (count == 0) return;
  const size_t offset = static_cast<size_t>(r) * count * rs.elem_size;
  const char* acc = inputs[r] + offset;
  for (int s = 1; s < n; ++s) {
    rs.fn(output, acc, inputs[(r + s) % n] + offset, count);
    acc = output;
  }
  if (acc != output) std::memcpy(output, acc, count * rs.elem_size);  // world 1
  if (rs.op == ReduceOp::AVG) detail::divide_in_place(output, rs.dtype, count, n);
  all_passed(c);
}

}  // namespace tdist::comm::algorithms
