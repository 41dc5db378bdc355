// Ring allgather: every rank sends its block to the right neighbour and forwards, chunk by
// chunk, each block it receives from the left (except the last one), so block i travels
// i, i+1, ..., i-1 around the ring. Received chunks land directly in the output (and are final
// there at once: a staged output copies them out while the rest arrives).

#include <algorithm>

#include "tdist/comm/algorithms/allgather_ring.h"
#include "tdist/comm/algorithms/overlapped_staging.h"

namespace tdist::comm::algorithms {

void allgather_ring(Context& c, const std::vector<char*>& blocks, size_t block_bytes,
                    Staging* staging) {
  const int n = c.size;
  if (n == 1 || block_bytes == 0) return;
  const int r = c.rank;
  const int right = (r + 1) % n;
  const int left = (r + n - 1) % n;
  const size_t chunk = c.chunk_bytes == 0 ? block_bytes : c.chunk_bytes;
  const size_t chunks_per_block = (block_bytes + chunk - 1) / chunk;
  send_staged(c, right, blocks[r], block_bytes, staging);
  for (int s = 0; s < n - 1; ++s) {
    char* block = blocks[(r - 1 - s + n) % n];
    for (size_t off = 0; off < block_bytes; off += chunk) {
      c.ex.recv(left, block + off, std::min(chunk, block_bytes - off),
                static_cast<uint64_t>(s) * chunks_per_block + off / chunk);
    }
  }
  c.ex.run([&](int, uint64_t cookie) {
    int s = static_cast<int>(cookie / chunks_per_block);
    size_t off = (cookie % chunks_per_block) * chunk;
    char* block = blocks[(r - 1 - s + n) % n];
    const size_t len = std::min(chunk, block_bytes - off);
    if (staging != nullptr) staging->finished_at(block + off, len);
    if (s < n - 2) c.ex.send(right, block + off, len);
  });
}

}  // namespace tdist::comm::algorithms
