// Gather and scatter straight between the root and every other rank: the root's exchange keeps
// all n-1 transfers in flight at once (on one thread), which on a small world beats a tree.

#include "tdist/comm/algorithms/gather_scatter_direct.h"
#include "tdist/comm/algorithms/overlapped_staging.h"

namespace tdist::comm::algorithms {

void gather_direct(Context& c, const char* input, const std::vector<char*>& blocks,
                   size_t block_bytes, int root, Staging* staging) {
  if (c.size == 1 || block_bytes == 0) return;
  if (c.rank != root) {
    send_staged(c, root, input, block_bytes, staging);
    c.ex.run();
    return;
  }
  for (int p = 0; p < c.size; ++p) {
    if (p == root) continue;
    if (staging != nullptr) {
      recv_chunks(c, p, blocks[p], block_bytes);
    } else {
      c.ex.recv(p, blocks[p], block_bytes);
    }
  }
  if (staging != nullptr) {
    run_finishing_chunks(c, blocks, std::vector<size_t>(c.size, block_bytes), *staging);
  } else {
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
  } else if (staging != nullptr) {
    recv_chunks(c, root, output, block_bytes);
    std::vector<char*> mine(c.size, nullptr);
    mine[root] = output;
    run_finishing_chunks(c, mine, std::vector<size_t>(c.size, block_bytes), *staging);
  } else {
    c.ex.recv(root, output, block_bytes);
    c.ex.run();
  }
}

}  // namespace tdist::comm::algorithms
