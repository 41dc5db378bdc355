// Single-copy broadcast and allgather between the processes of one host (Note [Single-copy
// collectives] in algorithms.h).

#include <errno.h>

#include <cstring>

#include "tdist/comm/algorithms/algorithms.h"
#include "tdist/core/error.h"
#include "tdist/core/process_memory.h"

namespace tdist::comm::algorithms {
namespace {

// Copies `bytes` of `peer`'s memory at `address` into `out`.
void read_peer(Context& c, int peer, uint64_t address, char* out, size_t bytes) {
  TDIST_CHECK(c.pids != nullptr, c.ex.where(), ": single-copy read without peer processes");
  const int err = try_read_process_memory((*c.pids)[peer], address, out, bytes);
  if (err == ESRCH) {
    throw NetworkError(str(c.ex.where(), ": lost rank ", peer, ": its process is gone (reading ",
                           bytes, " bytes from its memory)"));
  }
  if (err != 0) {
    throw NetworkError(str(c.ex.where(), ": reading ", bytes, " bytes from the memory of rank ",
                           peer, " failed: ", std::strerror(err)));
  }
}

// Sends this rank's address of `data` to every peer and receives theirs (by rank).
std::vector<uint64_t> exchange_addresses(Context& c, const char* data) {
  const uint64_t mine = reinterpret_cast<uint64_t>(data);
  std::vector<uint64_t> addresses(static_cast<size_t>(c.size));
  for (int p = 0; p < c.size; ++p) {
    if (p == c.rank) continue;
    c.ex.send(p, &mine, sizeof(mine));
    c.ex.recv(p, &addresses[p], sizeof(uint64_t));
  }
  c.ex.run();
  return addresses;
}

// One byte to every peer and one from each: every rank has passed this point.
void all_passed(Context& c) {
  const uint8_t mine = 1;
  std::vector<uint8_t> theirs(static_cast<size_t>(c.size));
  for (int p = 0; p < c.size; ++p) {
    if (p == c.rank) continue;
    c.ex.send(p, &mine, 1);
    c.ex.recv(p, &theirs[p], 1);
  }
  c.ex.run();
}

}  // namespace

void broadcast_single_copy(Context& c, char* data, size_t bytes, int root) {
  const int n = c.size;
  if (n == 1 || bytes == 0) return;
  if (c.rank == root) {
    const uint64_t address = reinterpret_cast<uint64_t>(data);
    std::vector<uint8_t> done(static_cast<size_t>(n));
    for (int p = 0; p < n; ++p) {
      if (p == root) continue;
      c.ex.send(p, &address, sizeof(address));
      c.ex.recv(p, &done[p], 1);
    }
    c.ex.run();
    return;
  }
  uint64_t address = 0;
  c.ex.recv(root, &address, sizeof(address));
  c.ex.run();
  read_peer(c, root, address, data, bytes);
  const uint8_t done = 1;
  c.ex.send(root, &done, 1);
  c.ex.run();
}

void allgather_single_copy(Context& c, const std::vector<char*>& blocks, size_t block_bytes) {
  const int n = c.size;
  const int r = c.rank;
  if (n == 1 || block_bytes == 0) return;
  const std::vector<uint64_t> addresses = exchange_addresses(c, blocks[r]);
  // Each rank starts with its right neighbour, so the ranks do not all read one rank at once.
  for (int s = 1; s < n; ++s) {
    const int p = (r + s) % n;
    read_peer(c, p, addresses[p], blocks[p], block_bytes);
  }
  all_passed(c);
}

}  // namespace tdist::comm::algorithms
