#pragma once
// Byte-level wire format shared by the store protocol, comm and RPC: little-endian integers and
// length-prefixed byte strings.
//
// Writer appends to a Bytes buffer. Reader reads from a bounded view and checks every length
// against the bytes that remain *before* allocating or copying: a peer cannot make us allocate
// more than it sent. Any violation throws ProtocolError. Neither class is thread safe.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "tdist/core/store.h"

namespace tdist::wire {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "tdist's wire format assumes a little-endian host");

class Writer {
 public:
  explicit Writer(Bytes& out) : out_(out) {}

  void raw(const void* data, size_t size) {
    const auto* p = static_cast<const uint8_t*>(data);
    out_.insert(out_.end(), p, p + size);
  }
  template <typename T>
  void pod(T value) {
    static_assert(std::is_arithmetic_v<T> || std::is_enum_v<T>);
    raw(&value, sizeof(T));
  }
  void u8(uint8_t v) { pod(v); }
  void u16(uint16_t v) { pod(v); }
  void u32(uint32_t v) { pod(v); }
  void u64(uint64_t v) { pod(v); }
  void i64(int64_t v) { pod(v); }
  // u64 length, then the bytes.
  void blob(const void* data, size_t size) {
    u64(size);
    raw(data, size);
  }
  void blob(const Bytes& b) { blob(b.data(), b.size()); }
  void string(std::string_view s) { blob(s.data(), s.size()); }

  Bytes& buffer() { return out_; }

 private:
  Bytes& out_;
};

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  explicit Reader(const Bytes& b) : Reader(b.data(), b.size()) {}
  // A Reader points into its bytes: a temporary would be gone before the first read.
  explicit Reader(Bytes&&) = delete;

  size_t remaining() const { return size_ - pos_; }
  size_t position() const { return pos_; }

  // Returns a pointer to the next `size` bytes and skips them.
  const uint8_t* raw(size_t size, const char* what = "field");
  template <typename T>
  T pod(const char* what = "field") {
    T v;
    std::memcpy(&v, raw(sizeof(T), what), sizeof(T));
    return v;
  }
  uint8_t u8(const char* what = "u8") { return pod<uint8_t>(what); }
  uint16_t u16(const char* what = "u16") { return pod<uint16_t>(what); }
  uint32_t u32(const char* what = "u32") { return pod<uint32_t>(what); }
  uint64_t u64(const char* what = "u64") { return pod<uint64_t>(what); }
  int64_t i64(const char* what = "i64") { return pod<int64_t>(what); }
  // A u64 length (checked against the remaining bytes and `max`), then that many bytes.
  Bytes blob(const char* what = "blob", uint64_t max = UINT64_MAX);
  std::string string(const char* what = "string", uint64_t max = UINT64_MAX);
  // Throws ProtocolError when bytes remain.
  void expect_end(const char* what = "message") const;
  // A u64 length, checked against the remaining bytes and `max`.
  uint64_t length(const char* what, uint64_t max = UINT64_MAX);

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace tdist::wire
