#pragma once
// Copies between user memory and a byte ring: the collectives' shared-memory rings
// (comm/transport/shm) and RPC's shared-memory frame streams (rpc/detail/shm_stream.h).

#include <sys/uio.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace tdist::byte_ring {

enum class Direction { kIntoRing, kOutOfRing };

// Copies up to `limit` bytes between the iovecs and a ring of `capacity` bytes whose logical
// offset `start` maps to ring[start % capacity], wrapping at the end. Stops at the first iovec
// that does not fit whole. Returns the bytes moved.
inline size_t copy(Direction dir, char* ring, size_t capacity, uint64_t start, const iovec* iov,
                   int count, size_t limit) {
  size_t moved = 0;
  for (int i = 0; i < count && limit > 0; ++i) {
    char* user = static_cast<char*>(iov[i].iov_base);
    size_t len = std::min(iov[i].iov_len, limit);
    size_t done = 0;
    while (done < len) {
      size_t pos = static_cast<size_t>((start + moved) % capacity);
      size_t n = std::min(len - done, capacity - pos);
      if (dir == Direction::kIntoRing) {
        std::memcpy(ring + pos, user + done, n);
      } else {
        std::memcpy(user + done, ring + pos, n);
      }
      done += n;
      moved += n;
    }
    limit -= len;
    if (len < iov[i].iov_len) break;
  }
  return moved;
}

}  // namespace tdist::byte_ring
