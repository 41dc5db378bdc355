// Pipelined broadcast along the chain root, root+1, ..., root+n-1: every rank but the root
// receives the buffer chunk by chunk and forwards each chunk to the next rank as soon as it
// arrived, so all links carry data at once and the time is ~ bytes/bandwidth + (n-2) chunks.

#include "tdist/comm/algorithms/broadcast_pipelined.h"
#include "tdist/comm/algorithms/overlapped_staging.h"

namespace tdist::comm::algorithms {

void broadcast_pipelined(Context& c, char* data, size_t bytes, int root, Staging* staging) {
  const int n = c.size;
  if (n == 1 || bytes == 0) return;
  const int pos = (c.rank - root + n) % n;
  const int prev = (c.rank + n - 1) % n;
  const int next = (c.rank + 1) % n;
  const bool forward = pos < n - 1;
  if (pos == 0) {
    send_staged(c, next, data, bytes, staging);
    c.ex.run();
    return;
  }
  const size_t chunk = c.chunk_bytes == 0 ? bytes : c.chunk_bytes;
  for (size_t off = 0; off < bytes; off += chunk) {
    c.ex.recv(prev, data + off, std::min(chunk, bytes - off), off);
  }
  c.ex.run([&](int, uint64_t off) {
    const size_t len = std::min(chunk, bytes - off);
    if (staging != nullptr) staging->finished_at(data + off, len);
    if (forward) c.ex.send(next, data + off, len);
  });
}

}  // namespace tdist::comm::algorithms
