#include "tdist/core/tensor_wire.h"

#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>

#include <cstring>

#include "tdist/core/error.h"

namespace tdist {
namespace {

bool known_dtype(int8_t dtype) {
  if (dtype < 0 || dtype >= static_cast<int8_t>(c10::ScalarType::NumOptions)) return false;
  switch (static_cast<c10::ScalarType>(dtype)) {
    case c10::ScalarType::Byte:
    case c10::ScalarType::Char:
    case c10::ScalarType::Short:
    case c10::ScalarType::Int:
    case c10::ScalarType::Long:
    case c10::ScalarType::Half:
    case c10::ScalarType::Float:
    case c10::ScalarType::Double:
    case c10::ScalarType::ComplexHalf:
    case c10::ScalarType::ComplexFloat:
    case c10::ScalarType::ComplexDouble:
    case c10::ScalarType::Bool:
    case c10::ScalarType::BFloat16:
    case c10::ScalarType::UInt16:
    case c10::ScalarType::UInt32:
    case c10::ScalarType::UInt64:
    case c10::ScalarType::Float8_e5m2:
    case c10::ScalarType::Float8_e4m3fn:
      return true;
    default:
      return false;
  }
}

}  // namespace

at::Tensor contiguous_values(const at::Tensor& t) {
  // The common case without the copies of the handle below (each a reference-count update,
  // on every small collective's path).
  if (!t.is_conj() && !t.is_neg() && t.is_contiguous()) return t;
  at::Tensor r = t;
  if (r.is_conj()) r = r.resolve_conj();
  if (r.is_neg()) r = r.resolve_neg();
  return r.contiguous();
}

TensorMeta describe_tensor(const at::Tensor& t) {
  TDIST_CHECK_ARG(t.defined(), "cannot send an undefined tensor");
  TDIST_CHECK_ARG(t.device().is_cpu(), "only CPU tensors can be encoded, got ", t.device());
  TDIST_CHECK_ARG(known_dtype(static_cast<int8_t>(t.scalar_type())), "unsupported dtype ",
                  t.scalar_type());
  TDIST_CHECK_ARG(static_cast<size_t>(t.dim()) <= TensorMeta::kMaxDims, "tensor has ", t.dim(),
                  " dimensions; at most ", TensorMeta::kMaxDims, " are supported");
  TensorMeta m;
  m.dtype = static_cast<int8_t>(t.scalar_type());
  m.shape = t.sizes().vec();
  m.nbytes = static_cast<uint64_t>(t.numel()) * t.element_size();
  return m;
}

void validate_tensor_meta(const TensorMeta& meta, uint64_t available) {
  if (!known_dtype(meta.dtype)) {
    throw ProtocolError(str("tensor has unknown dtype code ", int(meta.dtype)));
  }
  if (meta.shape.size() > TensorMeta::kMaxDims) {
    throw ProtocolError(str("tensor has ", meta.shape.size(), " dimensions; at most ",
                            TensorMeta::kMaxDims, " are allowed"));
  }
  const uint64_t elem = c10::elementSize(static_cast<c10::ScalarType>(meta.dtype));
  // The product of the non-zero dimensions, times the element size, must fit in int64 (what
  // at::empty computes): a zero dimension does not make [0, 2^62, 2^62] a valid shape.
  constexpr uint64_t kLimit = static_cast<uint64_t>(INT64_MAX);
  uint64_t numel = 1, nonzero = 1;
  for (int64_t d : meta.shape) {
    if (d < 0) throw ProtocolError(str("tensor has a negative dimension ", d));
    if (d == 0) {
      numel = 0;
      continue;
    }
    if (nonzero > kLimit / static_cast<uint64_t>(d)) throw ProtocolError("tensor shape overflows");
    nonzero *= static_cast<uint64_t>(d);
    numel *= static_cast<uint64_t>(d);
  }
  if (elem > kLimit / nonzero) throw ProtocolError("tensor size overflows");
  if (numel * elem != meta.nbytes) {
    throw ProtocolError(str("tensor byte count ", meta.nbytes, " does not match its shape (", numel,
                            " elements of ", elem, " bytes)"));
  }
  if (meta.nbytes > available) {
    throw ProtocolError(
        str("tensor needs ", meta.nbytes, " bytes but only ", available, " are available"));
  }
}

at::Tensor tensor_from_bytes(const TensorMeta& meta, const uint8_t* data, uint64_t available) {
  validate_tensor_meta(meta, available);
  at::Tensor t =
      at::empty(meta.shape, at::TensorOptions().dtype(static_cast<c10::ScalarType>(meta.dtype)));
  if (meta.nbytes) std::memcpy(t.data_ptr(), data, meta.nbytes);
  return t;
}

}  // namespace tdist
