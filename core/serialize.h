#pragma once
// cereal integration with bounded decoding.
//
// BytesOutputArchive appends to a Bytes buffer; BoundedInputArchive reads from a fixed view and
// (1) fails with ProtocolError instead of reading past the end, and (2) checks every collection
// count (cereal's SizeTag) against the bytes that remain *before* cereal resizes the container,
// so a forged count of 2^62 cannot make us allocate. Wire layout is cereal's binary layout,
// little-endian, sizes as u64.
//
// encode(value) / decode<T>(data, size) wrap them; decode() requires the whole input to be used.
// at::Tensor is serializable inline (TensorMeta, then the bytes; see tensor_wire.h).

#include <cereal/cereal.hpp>
#include <cereal/types/map.hpp>
#include <cereal/types/optional.hpp>
#include <cereal/types/string.hpp>
#include <cereal/types/tuple.hpp>
#include <cereal/types/utility.hpp>
#include <cereal/types/vector.hpp>

#include <cstring>
#include <type_traits>

#include "tdist/core/error.h"
#include "tdist/core/store.h"
#include "tdist/core/tensor_wire.h"

namespace tdist {

class BytesOutputArchive
    : public cereal::OutputArchive<BytesOutputArchive, cereal::AllowEmptyClassElision> {
 public:
  explicit BytesOutputArchive(Bytes& out)
      : cereal::OutputArchive<BytesOutputArchive, cereal::AllowEmptyClassElision>(this),
        out_(out) {}
  void saveBinary(const void* data, std::streamsize size) {
    const auto* p = static_cast<const uint8_t*>(data);
    out_.insert(out_.end(), p, p + size);
  }

 private:
  Bytes& out_;
};

class BoundedInputArchive
    : public cereal::InputArchive<BoundedInputArchive, cereal::AllowEmptyClassElision> {
 public:
  BoundedInputArchive(const uint8_t* data, size_t size)
      : cereal::InputArchive<BoundedInputArchive, cereal::AllowEmptyClassElision>(this),
        data_(data),
        size_(size) {}
  void loadBinary(void* data, std::streamsize size) {
    if (size < 0 || static_cast<size_t>(size) > remaining()) {
      throw ProtocolError(str("truncated message: needs ", size, " more bytes, ", remaining(),
                              " remain"));
    }
    if (size) std::memcpy(data, data_ + pos_, static_cast<size_t>(size));
    pos_ += static_cast<size_t>(size);
  }
  // Zero-copy access for large payloads (tensor bytes).
  const uint8_t* take(size_t size) {
    if (size > remaining()) {
      throw ProtocolError(str("truncated message: needs ", size, " more bytes, ", remaining(),
                              " remain"));
    }
    const uint8_t* p = data_ + pos_;
    pos_ += size;
    return p;
  }
  size_t remaining() const { return size_ - pos_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

template <class T>
std::enable_if_t<std::is_arithmetic_v<T>> CEREAL_SAVE_FUNCTION_NAME(BytesOutputArchive& ar,
                                                                     const T& t) {
  ar.saveBinary(std::addressof(t), sizeof(t));
}

template <class T>
std::enable_if_t<std::is_arithmetic_v<T>> CEREAL_LOAD_FUNCTION_NAME(BoundedInputArchive& ar,
                                                                     T& t) {
  ar.loadBinary(std::addressof(t), sizeof(t));
}

template <class Archive, class T>
CEREAL_ARCHIVE_RESTRICT(BoundedInputArchive, BytesOutputArchive)
CEREAL_SERIALIZE_FUNCTION_NAME(Archive& ar, cereal::NameValuePair<T>& t) {
  ar(t.value);
}

template <class T>
void CEREAL_SAVE_FUNCTION_NAME(BytesOutputArchive& ar, const cereal::SizeTag<T>& t) {
  uint64_t n = static_cast<uint64_t>(t.size);
  ar.saveBinary(&n, sizeof(n));
}

// Every element of a collection takes at least one byte on the wire (empty types aside), so a
// count larger than the remaining bytes is a lie; refuse it before cereal calls resize().
template <class T>
void CEREAL_LOAD_FUNCTION_NAME(BoundedInputArchive& ar, cereal::SizeTag<T>& t) {
  uint64_t n = 0;
  ar.loadBinary(&n, sizeof(n));
  if (n > ar.remaining()) {
    throw ProtocolError(str("collection count ", n, " exceeds the ", ar.remaining(),
                            " bytes that remain in the message"));
  }
  t.size = static_cast<std::remove_reference_t<T>>(n);
}

template <class T>
void CEREAL_SAVE_FUNCTION_NAME(BytesOutputArchive& ar, const cereal::BinaryData<T>& bd) {
  ar.saveBinary(bd.data, static_cast<std::streamsize>(bd.size));
}

template <class T>
void CEREAL_LOAD_FUNCTION_NAME(BoundedInputArchive& ar, cereal::BinaryData<T>& bd) {
  ar.loadBinary(bd.data, static_cast<std::streamsize>(bd.size));
}

// at::Tensor inline: TensorMeta, then the bytes (validated before allocation).
inline void CEREAL_SAVE_FUNCTION_NAME(BytesOutputArchive& ar, const at::Tensor& t) {
  TensorMeta meta = describe_tensor(t);
  ar(meta);
  at::Tensor c = contiguous_values(t);
  if (meta.nbytes) ar.saveBinary(c.data_ptr(), static_cast<std::streamsize>(meta.nbytes));
}

inline void CEREAL_LOAD_FUNCTION_NAME(BoundedInputArchive& ar, at::Tensor& t) {
  TensorMeta meta;
  ar(meta);
  validate_tensor_meta(meta, ar.remaining());
  t = tensor_from_bytes(meta, ar.take(meta.nbytes), meta.nbytes);
}

template <class... T>
Bytes encode(const T&... values) {
  Bytes out;
  {
    BytesOutputArchive ar(out);
    ar(values...);
  }
  return out;
}

// Decodes exactly one T from [data, data + size); ProtocolError on any malformed input.
template <class T>
T decode(const uint8_t* data, size_t size) {
  T value{};
  BoundedInputArchive ar(data, size);
  try {
    ar(value);
  } catch (const cereal::Exception& e) {
    throw ProtocolError(str("malformed message: ", e.what()));
  }
  if (ar.remaining() != 0) {
    throw ProtocolError(str("malformed message: ", ar.remaining(), " trailing bytes"));
  }
  return value;
}

template <class T>
T decode(const Bytes& b) {
  return decode<T>(b.data(), b.size());
}

}  // namespace tdist

CEREAL_REGISTER_ARCHIVE(tdist::BytesOutputArchive)
CEREAL_REGISTER_ARCHIVE(tdist::BoundedInputArchive)
CEREAL_SETUP_ARCHIVE_TRAITS(tdist::BoundedInputArchive, tdist::BytesOutputArchive)
