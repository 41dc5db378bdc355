#pragma once
// Tensor wire format: a tensor travels as its metadata (dtype, shape, byte count) followed by its
// bytes in row-major contiguous order. Only CPU tensors are encoded; a non-contiguous tensor is
// made contiguous first (a copy), and a conjugate or negative view
// is resolved (contiguous_values). Decoding validates the dtype, the rank, every dimension and the
// byte count against the bytes available *before* allocating the result.
//
// A tensor is written with core/serialize.h's archive: inline (TensorMeta, then its bytes), or in
// RPC as an index whose TensorMeta travels in the frame's tensor section and whose bytes travel
// beside the frame; tensor_from_bytes(meta, data, available) rebuilds one from bytes in memory.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace tdist {

struct TensorMeta {
  static constexpr size_t kMaxDims = 64;

  int8_t dtype = 0;  // c10::ScalarType
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(dtype, shape, nbytes);
  }
};

// The values `t` shows, as a contiguous tensor: a conjugate or negative view (a bit over its
// base's unchanged storage, e.g. x.conj() of a complex x) is resolved first, a non-contiguous
// tensor copied. Returns `t` itself when neither applies. Everything that sends a tensor's bytes
// (collectives, send/recv, the wire format, RPC) goes through this.
at::Tensor contiguous_values(const at::Tensor& t);

// Metadata of a CPU tensor (as it would be after contiguous_values()).
TensorMeta describe_tensor(const at::Tensor& t);

// Checks that `meta` describes a valid tensor whose bytes fit in `available`: known dtype, at most
// kMaxDims dimensions, no negative dimension, numel * element size == nbytes without overflow.
// Throws ProtocolError naming what is wrong.
void validate_tensor_meta(const TensorMeta& meta, uint64_t available);

// A new CPU tensor holding a copy of `data`, after validate_tensor_meta(meta, available).
at::Tensor tensor_from_bytes(const TensorMeta& meta, const uint8_t* data, uint64_t available);

}  // namespace tdist
