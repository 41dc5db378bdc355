#pragma once
// FNV-1a (64-bit): a cheap, stable hash for fingerprints that every rank computes alike
// (function signatures, group tokens, parameter checksums). Not for anything adversarial.

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tdist {

inline constexpr uint64_t kFnv1aOffset = 14695981039346656037ULL;

// Continues hash `h` over [data, data + size); start with kFnv1aOffset.
inline uint64_t fnv1a64(const void* data, size_t size, uint64_t h = kFnv1aOffset) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) {
    h ^= p[i];
    h *= 1099511628211ULL;
  }
  return h;
}

inline uint64_t fnv1a64(std::string_view s) { return fnv1a64(s.data(), s.size()); }

}  // namespace tdist
