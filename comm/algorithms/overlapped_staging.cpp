// Staging for the algorithms (Note [Overlapped staging] in overlapped_staging.h).

#include "tdist/comm/algorithms/overlapped_staging.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>

namespace tdist::comm::algorithms {

Staging::Staging(const char* base, std::vector<ByteRange> order)
    : base_(base), order_(std::move(order)) {
  by_offset_.reserve(order_.size());
  for (size_t i = 0; i < order_.size(); ++i) by_offset_.emplace_back(order_[i].begin, i);
  std::sort(by_offset_.begin(), by_offset_.end());
}

size_t Staging::last_piece(size_t begin, size_t end) const {
  // The pieces are disjoint: walk down from the last one that starts before `end`.
  auto it = std::lower_bound(by_offset_.begin(), by_offset_.end(), std::make_pair(end, size_t{0}));
  size_t last = kNoPiece;
  while (it != by_offset_.begin()) {
    --it;
    if (order_[it->second].end <= begin) break;
    last = last == kNoPiece ? it->second : std::max(last, it->second);
  }
  return last;
}

void Staging::await_arrival(size_t begin, size_t end) {
  const size_t last = last_piece(begin, end);
  if (last == kNoPiece) return;
  while (!arrived(last)) std::this_thread::sleep_for(std::chrono::microseconds(50));
}

void Staging::send(Context& c, int peer, const char* p, size_t n) {
  const auto b = static_cast<size_t>(p - base_), e = b + n;
  size_t at = b;  // sent up to here; bytes outside every piece go ungated
  // The pieces that overlap [b, e), by offset.
  auto it = std::upper_bound(by_offset_.begin(), by_offset_.end(), std::make_pair(b, SIZE_MAX));
  if (it != by_offset_.begin()) --it;
  for (; it != by_offset_.end() && it->first < e; ++it) {
    const ByteRange& piece = order_[it->second];
    const size_t lo = std::max(b, piece.begin), hi = std::min(e, piece.end);
    if (lo >= hi) continue;
    if (at < lo) c.ex.send(peer, base_ + at, lo - at);
    c.ex.send(peer, base_ + lo, hi - lo, detail::Gate{-1, 0, this, it->second});
    at = hi;
  }
  if (at < e) c.ex.send(peer, base_ + at, e - at);
}

namespace {
size_t chunk_of(const Context& c) { return std::max<size_t>(c.chunk_bytes, 1); }
}  // namespace

void recv_chunks(Context& c, int peer, char* p, size_t n) {
  for (size_t off = 0; off < n; off += chunk_of(c)) {
    c.ex.recv(peer, p + off, std::min(chunk_of(c), n - off), off);
  }
}

void run_finishing_chunks(Context& c, const std::vector<char*>& recv,
                          const std::vector<size_t>& recv_bytes, Staging& staging) {
  c.ex.run([&](int peer, uint64_t off) {
    staging.finished_at(recv[peer] + off, std::min(chunk_of(c), recv_bytes[peer] - off));
  });
}

}  // namespace tdist::comm::algorithms
