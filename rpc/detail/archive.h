#pragma once
// The cereal archives for call arguments and results (Note [RPC wire format] in message.h).
//
// They follow core/serialize.h's BytesOutputArchive / BoundedInputArchive (bounded reads, every
// collection count checked against the bytes that remain before cereal resizes anything) with two
// differences that are why RPC has its own pair:
//   - an at::Tensor is written as an index into the message's tensor list; its bytes travel
//     beside the frame (scatter-gather on send, read straight into the new tensor on receive);
//   - an RRef is written as fork data, and serializing one runs the RRef protocol
//     (Note [RRef protocol]), so the archives carry the RRef context and the peer's rank.
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

#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "tdist/core/error.h"
#include "tdist/core/store.h"

namespace tdist::rpc::detail {

class RRefContext;

// What encoding one outgoing message needs besides the bytes.
struct SendContext {
  std::vector<at::Tensor>* tensors = nullptr;  // the message's tensors, in index order
  RRefContext* rrefs = nullptr;
  int dest_rank = -1;
  bool has_rrefs = false;  // set when an RRef was written (the receiver decodes on a pool thread)
};

// What decoding one incoming message needs besides the bytes.
struct RecvContext {
  const std::vector<at::Tensor>* tensors = nullptr;
  RRefContext* rrefs = nullptr;
  int from_rank = -1;
};

class ArgOutputArchive
    : public cereal::OutputArchive<ArgOutputArchive, cereal::AllowEmptyClassElision> {
 public:
  ArgOutputArchive(Bytes& out, SendContext& ctx)
      : cereal::OutputArchive<ArgOutputArchive, cereal::AllowEmptyClassElision>(this),
        out_(out),
        ctx_(ctx) {}
  void saveBinary(const void* data, std::streamsize size) {
    const auto* p = static_cast<const uint8_t*>(data);
    out_.insert(out_.end(), p, p + size);
  }
  SendContext& context() { return ctx_; }

 private:
  Bytes& out_;
  SendContext& ctx_;
};

class ArgInputArchive
    : public cereal::InputArchive<ArgInputArchive, cereal::AllowEmptyClassElision> {
 public:
  ArgInputArchive(const uint8_t* data, size_t size, RecvContext& ctx)
      : cereal::InputArchive<ArgInputArchive, cereal::AllowEmptyClassElision>(this),
        data_(data),
        size_(size),
        ctx_(ctx) {}
  void loadBinary(void* data, std::streamsize size) {
    if (size < 0 || static_cast<size_t>(size) > remaining()) {
      throw ProtocolError(str("truncated arguments: need ", size, " more bytes, ", remaining(),
                              " remain"));
    }
    if (size) std::memcpy(data, data_ + pos_, static_cast<size_t>(size));
    pos_ += static_cast<size_t>(size);
  }
  size_t remaining() const { return size_ - pos_; }
  RecvContext& context() { return ctx_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  RecvContext& ctx_;
};

template <class T>
std::enable_if_t<std::is_arithmetic_v<T>> CEREAL_SAVE_FUNCTION_NAME(ArgOutputArchive& ar,
                                                                     const T& t) {
  ar.saveBinary(std::addressof(t), sizeof(t));
}

template <class T>
std::enable_if_t<std::is_arithmetic_v<T>> CEREAL_LOAD_FUNCTION_NAME(ArgInputArchive& ar, T& t) {
  ar.loadBinary(std::addressof(t), sizeof(t));
}

template <class Archive, class T>
CEREAL_ARCHIVE_RESTRICT(ArgInputArchive, ArgOutputArchive)
CEREAL_SERIALIZE_FUNCTION_NAME(Archive& ar, cereal::NameValuePair<T>& t) {
  ar(t.value);
}

template <class T>
void CEREAL_SAVE_FUNCTION_NAME(ArgOutputArchive& ar, const cereal::SizeTag<T>& t) {
  uint64_t n = static_cast<uint64_t>(t.size);
  ar.saveBinary(&n, sizeof(n));
}

// Every element takes at least one byte on the wire, so a count larger than the bytes that remain
// is a lie: refuse it before cereal calls resize().
template <class T>
void CEREAL_LOAD_FUNCTION_NAME(ArgInputArchive& ar, cereal::SizeTag<T>& t) {
  uint64_t n = 0;
  ar.loadBinary(&n, sizeof(n));
  if (n > ar.remaining()) {
    throw ProtocolError(str("collection count ", n, " exceeds the ", ar.remaining(),
                            " bytes that remain in the arguments"));
  }
  t.size = static_cast<std::remove_reference_t<T>>(n);
}

template <class T>
void CEREAL_SAVE_FUNCTION_NAME(ArgOutputArchive& ar, const cereal::BinaryData<T>& bd) {
  ar.saveBinary(bd.data, static_cast<std::streamsize>(bd.size));
}

template <class T>
void CEREAL_LOAD_FUNCTION_NAME(ArgInputArchive& ar, cereal::BinaryData<T>& bd) {
  ar.loadBinary(bd.data, static_cast<std::streamsize>(bd.size));
}

// A tensor is its index in the message's tensor list (kUndefinedTensor for an undefined one).
constexpr uint32_t kUndefinedTensor = std::numeric_limits<uint32_t>::max();

void save_tensor(ArgOutputArchive& ar, const at::Tensor& t);
void load_tensor(ArgInputArchive& ar, at::Tensor& t);

// Found by argument-dependent lookup on the archive's namespace.
inline void CEREAL_SAVE_FUNCTION_NAME(ArgOutputArchive& ar, const at::Tensor& t) {
  save_tensor(ar, t);
}
inline void CEREAL_LOAD_FUNCTION_NAME(ArgInputArchive& ar, at::Tensor& t) { load_tensor(ar, t); }

}  // namespace tdist::rpc::detail

CEREAL_REGISTER_ARCHIVE(tdist::rpc::detail::ArgOutputArchive)
CEREAL_REGISTER_ARCHIVE(tdist::rpc::detail::ArgInputArchive)
CEREAL_SETUP_ARCHIVE_TRAITS(tdist::rpc::detail::ArgInputArchive,
                            tdist::rpc::detail::ArgOutputArchive)
