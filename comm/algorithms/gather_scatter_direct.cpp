// Gather and scatter straight between the root and every other rank: the root's exchange keeps
// all n-1 transfers in flight at once (on one thread), which on a small world beats a tree.

#include "tdist/comm/algorithms/algorithms.h"

namespace tdist::comm::algorithms {

void gather_direct(Context& c, const char* input, const std::vector<char*>& blocks,
                   size_t block_bytes, int root) {
  if (c.size == 1 || block_bytes == 0) return;
  if (c.rank == root) {
    for (int p = 0; p < c.size; ++p) {
      if (p != root) c.ex.recv(p, blocks[p], block_bytes);
    }
  } else {
    c.ex.send(root, input, block_bytes);
  }
  c.ex.run();
}

void scatter_direct(Context& c, const std::vector<const char*>& blocks, char* output,
                    size_t block_bytes, int root) {
  if (c.size == 1 || block_bytes == 0) return;
  if (c.rank == root) {
    for (int p = 0; p < c.size; ++p) {
      if (p != root) c.ex.send(p, blocks[p], block_bytes);
    }
  } else {
    c.ex.recv(root, output, block_bytes);
  }
  c.ex.run();
}

}  // namespace tdist::comm::algorithms
