#pragma once
// The serializer of every structured wire message: cereal archives over core/wire.h's bytes.
//
// Note [Wire serialization]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// core/wire.h's Writer and Reader lay out and bound the bytes: little-endian numbers, u64
// lengths, every read checked against what remains. Fixed-layout headers (the store frames, the
// mesh hello, the point-to-point headers, the checkpoint head) call them directly. Everything with
// structure (strings, vectors, maps, tuples, types with a serialize()) goes through the one
// archive pair of this file, WireOutputArchive / WireInputArchive: cereal's front end over that
// Writer and Reader. The layout is cereal's binary layout, which is wire.h's: numbers as they
// are, a collection as its count (u64) then its elements, a string as its length then its bytes.
//
// Decoding is bounded. A read past the end is a ProtocolError. A collection's count is checked
// before anything is allocated for it: count * the fewest bytes one element takes on the wire
// (MinWireSize) must fit in the bytes that remain. So neither 2^40 strings announced in a 20-byte
// message nor 1M strings announced in 1 MB (32 MB of std::string before the first one is read)
// cost more than the message itself.
//
// An archive takes a Context: what it carries besides its bytes. The context decides how the
// types that are not plain data travel:
//   - NoContext (BytesOutputArchive / BoundedInputArchive, encode / decode): an at::Tensor is
//     written inline, its TensorMeta then its bytes (core/tensor_wire.h);
//   - RPC's SendContext / RecvContext (rpc/detail/archive.h): an at::Tensor is an index into the
//     message's tensor list, its bytes travel beside the frame; an RRef runs the RRef protocol.
//     Those encodings are declared there (found by argument-dependent lookup on the context), so
//     writing an RRef outside a call does not compile.
// Neither archive is thread safe; each lives for the encoding or decoding of one message.

#include <ATen/core/Tensor.h>
#include <cereal/cereal.hpp>
#include <cereal/types/array.hpp>
#include <cereal/types/map.hpp>
#include <cereal/types/optional.hpp>
#include <cereal/types/set.hpp>
#include <cereal/types/string.hpp>
#include <cereal/types/tuple.hpp>
#include <cereal/types/unordered_map.hpp>
#include <cereal/types/utility.hpp>
#include <cereal/types/vector.hpp>

#include <array>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tdist/core/error.h"
#include "tdist/core/store.h"
#include "tdist/core/tensor_wire.h"
#include "tdist/core/wire.h"

namespace tdist {

// The fewest bytes one T takes on the wire: what a collection count is multiplied by before
// anything is allocated. A type not listed takes at least one byte (empty types aside).
template <class T, class = void>
struct MinWireSize : std::integral_constant<size_t, 1> {};
template <class T>
struct MinWireSize<T, std::enable_if_t<std::is_arithmetic_v<T> || std::is_enum_v<T>>>
    : std::integral_constant<size_t, sizeof(T)> {};
// Collections: their count.
template <class... A>
struct MinWireSize<std::basic_string<A...>> : std::integral_constant<size_t, 8> {};
template <class... A>
struct MinWireSize<std::vector<A...>> : std::integral_constant<size_t, 8> {};
template <class... A>
struct MinWireSize<std::map<A...>> : std::integral_constant<size_t, 8> {};
template <class... A>
struct MinWireSize<std::set<A...>> : std::integral_constant<size_t, 8> {};
template <class... A>
struct MinWireSize<std::unordered_map<A...>> : std::integral_constant<size_t, 8> {};
template <class T>
struct MinWireSize<std::optional<T>> : std::integral_constant<size_t, 1> {};
template <class T, size_t N>
struct MinWireSize<std::array<T, N>> : std::integral_constant<size_t, N * MinWireSize<T>::value> {};
template <class A, class B>
struct MinWireSize<std::pair<A, B>>
    : std::integral_constant<size_t, MinWireSize<A>::value + MinWireSize<B>::value> {};
template <class... T>
struct MinWireSize<std::tuple<T...>>
    : std::integral_constant<size_t, (size_t{0} + ... + MinWireSize<T>::value)> {};
template <>  // dtype, the shape's count, nbytes
struct MinWireSize<TensorMeta> : std::integral_constant<size_t, 1 + 8 + 8> {};
// An index (u32) in a call; inline, its TensorMeta is larger.
template <>
struct MinWireSize<at::Tensor> : std::integral_constant<size_t, 4> {};

// No context: tensors inline.
struct NoContext {};

template <class Context>
class WireOutputArchive
    : public cereal::OutputArchive<WireOutputArchive<Context>, cereal::AllowEmptyClassElision> {
  using Base = cereal::OutputArchive<WireOutputArchive<Context>, cereal::AllowEmptyClassElision>;

 public:
  WireOutputArchive(Bytes& out, Context& ctx) : Base(this), w_(out), ctx_(&ctx) {}
  template <class C = Context, class = std::enable_if_t<std::is_same_v<C, NoContext>>>
  explicit WireOutputArchive(Bytes& out) : Base(this), w_(out) {}

  void saveBinary(const void* data, std::streamsize size) {
    w_.raw(data, static_cast<size_t>(size));
  }
  Context& context() { return *ctx_; }

 private:
  wire::Writer w_;
  Context* ctx_ = nullptr;
};

template <class Context>
class WireInputArchive
    : public cereal::InputArchive<WireInputArchive<Context>, cereal::AllowEmptyClassElision> {
  using Base = cereal::InputArchive<WireInputArchive<Context>, cereal::AllowEmptyClassElision>;

 public:
  WireInputArchive(const uint8_t* data, size_t size, Context& ctx)
      : Base(this), r_(data, size), ctx_(&ctx) {}
  template <class C = Context, class = std::enable_if_t<std::is_same_v<C, NoContext>>>
  WireInputArchive(const uint8_t* data, size_t size) : Base(this), r_(data, size) {}

  void loadBinary(void* data, std::streamsize size) {
    if (size < 0) throw ProtocolError(str("negative field size ", size));
    const uint8_t* p = r_.raw(static_cast<size_t>(size), "message field");
    if (size) std::memcpy(data, p, static_cast<size_t>(size));
  }
  // Zero-copy access to the next `size` bytes (tensor bytes).
  const uint8_t* take(size_t size) { return r_.raw(size, "tensor bytes"); }
  // A collection count, refused unless count elements of at least `min_element_bytes` each
  // (at least one) fit in the bytes that remain.
  uint64_t count(size_t min_element_bytes) {
    const uint64_t n = r_.u64("collection count");
    const size_t each = min_element_bytes ? min_element_bytes : 1;
    if (n > remaining() / each) {
      throw ProtocolError(str("collection count ", n, " of elements of at least ", each,
                              " bytes exceeds the ", remaining(),
                              " bytes that remain in the message"));
    }
    return n;
  }
  size_t remaining() const { return r_.remaining(); }
  Context& context() { return *ctx_; }

 private:
  wire::Reader r_;
  Context* ctx_ = nullptr;
};

using BytesOutputArchive = WireOutputArchive<NoContext>;
using BoundedInputArchive = WireInputArchive<NoContext>;

template <class C, class T>
std::enable_if_t<std::is_arithmetic_v<T>> CEREAL_SAVE_FUNCTION_NAME(WireOutputArchive<C>& ar,
                                                                    const T& t) {
  ar.saveBinary(std::addressof(t), sizeof(t));
}

template <class C, class T>
std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool>> CEREAL_LOAD_FUNCTION_NAME(
    WireInputArchive<C>& ar, T& t) {
  ar.loadBinary(std::addressof(t), sizeof(t));
}

// A bool is one byte, 0 or 1: any other byte is refused (copied into a bool, it would be a value
// the type cannot hold).
template <class C>
void CEREAL_LOAD_FUNCTION_NAME(WireInputArchive<C>& ar, bool& b) {
  uint8_t byte = 0;
  ar.loadBinary(&byte, 1);
  if (byte > 1) throw ProtocolError(str("bool field holds ", int(byte), ", not 0 or 1"));
  b = byte != 0;
}

// cereal reads an array of arithmetic values as raw bytes; bools one by one, as above.
template <class C, size_t N>
void CEREAL_LOAD_FUNCTION_NAME(WireInputArchive<C>& ar, std::array<bool, N>& a) {
  for (bool& b : a) ar(b);
}

template <class C, class T>
void CEREAL_SERIALIZE_FUNCTION_NAME(WireOutputArchive<C>& ar, cereal::NameValuePair<T>& t) {
  ar(t.value);
}

template <class C, class T>
void CEREAL_SERIALIZE_FUNCTION_NAME(WireInputArchive<C>& ar, cereal::NameValuePair<T>& t) {
  ar(t.value);
}

template <class C, class T>
void CEREAL_SAVE_FUNCTION_NAME(WireOutputArchive<C>& ar, const cereal::SizeTag<T>& t) {
  uint64_t n = static_cast<uint64_t>(t.size);
  ar.saveBinary(&n, sizeof(n));
}

// The count of a collection whose element type cereal does not tell us (strings, maps, sets):
// at least one byte per element. Vectors, the collections that are resized before their
// elements are read, are loaded below with their element's MinWireSize.
template <class C, class T>
void CEREAL_LOAD_FUNCTION_NAME(WireInputArchive<C>& ar, cereal::SizeTag<T>& t) {
  t.size = static_cast<std::remove_reference_t<T>>(ar.count(1));
}

template <class C, class T>
void CEREAL_SAVE_FUNCTION_NAME(WireOutputArchive<C>& ar, const cereal::BinaryData<T>& bd) {
  ar.saveBinary(bd.data, static_cast<std::streamsize>(bd.size));
}

template <class C, class T>
void CEREAL_LOAD_FUNCTION_NAME(WireInputArchive<C>& ar, cereal::BinaryData<T>& bd) {
  ar.loadBinary(bd.data, static_cast<std::streamsize>(bd.size));
}

// Same layout as cereal's vector load (count, then the elements), with the count checked
// against its element's size before the vector is resized.
template <class C, class T, class A>
void CEREAL_LOAD_FUNCTION_NAME(WireInputArchive<C>& ar, std::vector<T, A>& v) {
  const uint64_t n = ar.count(MinWireSize<T>::value);
  v.resize(static_cast<size_t>(n));
  if constexpr (std::is_arithmetic_v<T>) {
    if (n) ar.loadBinary(v.data(), static_cast<std::streamsize>(n * sizeof(T)));
  } else {
    for (auto& e : v) ar(e);
  }
}

template <class C, class A>
void CEREAL_LOAD_FUNCTION_NAME(WireInputArchive<C>& ar, std::vector<bool, A>& v) {
  const uint64_t n = ar.count(sizeof(bool));
  v.resize(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) {
    bool b = false;
    ar(b);
    v[i] = b;
  }
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
