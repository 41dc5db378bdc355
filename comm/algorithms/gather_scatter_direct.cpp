// Gather and scatter straight between the root and every other rank: the root's exchange keeps
// all n-1 transfers in flight at once (on one thread), which on a small world beats a tree.

#include <algorithm>

#include "tdist/comm/algorithms/algorithms.h"

namespace tdist::comm::algorithms {
namespace {

size_t chunk_of(const Context& c) { return std::max<size_t>(c.chunk_bytes, 1); }

// Receives block_bytes into `block` from `peer`: whole, or with `staging` chunk by chunk (the
// cookie is the chunk's offset), so that each chunk can be finished as it lands.
void recv_block(Context& c, int peer, char* block, size_t block_bytes, Staging* staging) {
  const size_t chunk = staging != nullptr ? chunk_of(c) : block_bytes;
  for (size_t off = 0; off < block_bytes; off += chunk) {
    c.ex.recv(peer, block + off, std::min(chunk, block_bytes - off), off);
  }
}

// Runs the exchange; with `staging`, every received chunk of blocks[peer] is finished.
void run_finishing(Context& c, const std::vector<char*>& blocks, size_t block_bytes,
                   Staging* staging) {
  if (staging == nullptr) {
    c.ex.run();
    return;
  }
  c.ex.run([&](int peer, uint64_t off) {
    staging->finished_at(blocks[peer] + off, std::min(chunk_of(c), block_bytes - off));
  });
}

}  // namespace

void gather_direct(Context& c, const char* input, const std::vector<char*>& blocks,
                   size_t block_bytes, int root, Staging* staging) {
  if (c.size == 1 || block_bytes == 0) return;
  if (c.rank == root) {
    for (int p = 0; p < c.size; ++p) {
      if (p != root) recv_block(c, p, blocks[p], block_bytes, staging);
    }
    run_finishing(c, blocks, block_bytes, staging);
  } else {
    send_staged(c, root, input, block_bytes, staging);
    c.ex.run();
  }
}

void scatter_direct(Context& c, const std::vector<const char*>& blocks, char* output,
                    size_t block_bytes, int root, Staging* staging) {
  if (c.size == 1 || block_bytes == 0) return;
  if (c.rank == root) {
    for (int p = 0; p < c.size; ++p) {
      if (p != root) send_staged(c, p, blocks[p], block_bytes, staging);
    }
    c.ex.run();
  } else {
    recv_block(c, root, output, block_bytes, staging);
    std::vector<char*> mine(c.size, nullptr);
    mine[root] = output;
    run_finishing(c, mine, block_bytes, staging);
  }
}

}  // namespace tdist::comm::algorithms
