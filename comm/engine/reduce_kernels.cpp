#include "tdist/comm/engine/reduce_kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/complex.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "tdist/core/error.h"

namespace tdist::comm::detail {
namespace {

struct Sum {
  template <typename T>
  static T apply(T a, T b) {
    return a + b;
  }
};
struct Prod {
  template <typename T>
  static T apply(T a, T b) {
    return a * b;
  }
};
// Note [MIN/MAX semantics]
//   Floating point follows torch.minimum / torch.maximum: a NaN in either operand gives NaN.
//   Algorithms apply a kernel as a op b on one rank and b op a on another (recursive doubling)
//   and group operands differently per chunk, so the kernels must be commutative and associative
//   down to the bits, or ranks end with different results: the NaN is always the canonical quiet
//   NaN (whatever payload or sign the input NaN had), and between zeros MIN gives -0.0 and MAX
//   +0.0 (IEEE 754-2019 minimum/maximum). Integers: the usual order.
struct Min {
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) {
      if (a != a || b != b) return std::numeric_limits<T>::quiet_NaN();
      if (a == b) return std::signbit(a) ? a : b;
    }
    return b < a ? b : a;
  }
};
struct Max {
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) {
      if (a != a || b != b) return std::numeric_limits<T>::quiet_NaN();
      if (a == b) return std::signbit(a) ? b : a;
    }
    return a < b ? b : a;
  }
};
struct BAnd {
  template <typename T>
  static T apply(T a, T b) {
    return a & b;
  }
};
struct BOr {
  template <typename T>
  static T apply(T a, T b) {
    return a | b;
  }
};
struct BXor {
  template <typename T>
  static T apply(T a, T b) {
    return a ^ b;
  }
};

// One loop per (T, Op); GCC vectorizes it (the file is compiled with -O3). `out` may alias `a`,
// so no __restrict; the compiler versions the loop with a runtime overlap check.
template <typename T, typename Op>
void kernel(void* out, const void* a, const void* b, size_t n) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = Op::template apply<T>(x[i], y[i]);
}

// float16/bfloat16: convert to float32, reduce, round, in blocks that stay in L1.
template <typename T, typename Op>
void kernel_lowp(void* out, const void* a, const void* b, size_t n) {
  constexpr size_t kBlock = 256;
  float fa[kBlock];
  float fb[kBlock];
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t base = 0; base < n; base += kBlock) {
    size_t m = std::min(kBlock, n - base);
    for (size_t i = 0; i < m; ++i) fa[i] = static_cast<float>(x[base + i]);
    for (size_t i = 0; i < m; ++i) fb[i] = static_cast<float>(y[base + i]);
    for (size_t i = 0; i < m; ++i) fa[i] = Op::template apply<float>(fa[i], fb[i]);
    for (size_t i = 0; i < m; ++i) o[base + i] = static_cast<T>(fa[i]);
  }
}

// Bool as bytes holding 0/1.
template <typename Op>
void kernel_bool(void* out, const void* a, const void* b, size_t n) {
  kernel<uint8_t, Op>(out, a, b, n);
}

template <typename T>
ReduceFn integer_kernel(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
      return &kernel<T, Sum>;
    case ReduceOp::PRODUCT:
      return &kernel<T, Prod>;
    case ReduceOp::MIN:
      return &kernel<T, Min>;
    case ReduceOp::MAX:
      return &kernel<T, Max>;
    case ReduceOp::BAND:
      return &kernel<T, BAnd>;
    case ReduceOp::BOR:
      return &kernel<T, BOr>;
    case ReduceOp::BXOR:
      return &kernel<T, BXor>;
    case ReduceOp::AVG:
      return nullptr;
  }
  return nullptr;
}

template <typename T>
ReduceFn float_kernel(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
      return &kernel<T, Sum>;
    case ReduceOp::PRODUCT:
      return &kernel<T, Prod>;
    case ReduceOp::MIN:
      return &kernel<T, Min>;
    case ReduceOp::MAX:
      return &kernel<T, Max>;
    default:
      return nullptr;
  }
}

template <typename T>
ReduceFn lowp_kernel(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
      return &kernel_lowp<T, Sum>;
    case ReduceOp::PRODUCT:
      return &kernel_lowp<T, Prod>;
    case ReduceOp::MIN:
      return &kernel_lowp<T, Min>;
    case ReduceOp::MAX:
      return &kernel_lowp<T, Max>;
    default:
      return nullptr;
  }
}

template <typename T>
ReduceFn complex_kernel(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
      return &kernel<T, Sum>;
    case ReduceOp::PRODUCT:
      return &kernel<T, Prod>;
    default:
      return nullptr;
  }
}

ReduceFn bool_kernel(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::MAX:
    case ReduceOp::BOR:
      return &kernel_bool<BOr>;
    case ReduceOp::PRODUCT:
    case ReduceOp::MIN:
    case ReduceOp::BAND:
      return &kernel_bool<BAnd>;
    case ReduceOp::BXOR:
      return &kernel_bool<BXor>;
    case ReduceOp::AVG:
      return nullptr;
  }
  return nullptr;
}

ReduceFn lookup(c10::ScalarType dtype, ReduceOp op) {
  using c10::ScalarType;
  switch (dtype) {
    case ScalarType::Byte:
      return integer_kernel<uint8_t>(op);
    case ScalarType::Char:
      return integer_kernel<int8_t>(op);
    case ScalarType::Short:
      return integer_kernel<int16_t>(op);
    case ScalarType::Int:
      return integer_kernel<int32_t>(op);
    case ScalarType::Long:
      return integer_kernel<int64_t>(op);
    case ScalarType::UInt16:
      return integer_kernel<uint16_t>(op);
    case ScalarType::UInt32:
      return integer_kernel<uint32_t>(op);
    case ScalarType::UInt64:
      return integer_kernel<uint64_t>(op);
    case ScalarType::Float:
      return float_kernel<float>(op);
    case ScalarType::Double:
      return float_kernel<double>(op);
    case ScalarType::Half:
      return lowp_kernel<c10::Half>(op);
    case ScalarType::BFloat16:
      return lowp_kernel<c10::BFloat16>(op);
    case ScalarType::ComplexFloat:
      return complex_kernel<c10::complex<float>>(op);
    case ScalarType::ComplexDouble:
      return complex_kernel<c10::complex<double>>(op);
    case ScalarType::Bool:
      return bool_kernel(op);
    default:
      return nullptr;
  }
}

template <typename T, typename S>
void divide(void* data, size_t n, S divisor) {
  T* p = static_cast<T*>(data);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<T>(static_cast<S>(p[i]) / divisor);
}

}  // namespace

bool reduce_supported(c10::ScalarType dtype, ReduceOp op) { return lookup(dtype, op) != nullptr; }

ReduceFn reduce_kernel(c10::ScalarType dtype, ReduceOp op) {
  ReduceFn fn = lookup(dtype, op);
  TDIST_CHECK_ARG(fn != nullptr, "reduce op ", to_string(op), " is not supported for dtype ",
                  c10::toString(dtype),
                  " (bitwise ops need integer or bool tensors, AVG needs floating-point or complex "
                  "tensors, MIN/MAX are not defined for complex tensors)");
  return fn;
}

void divide_in_place(void* data, c10::ScalarType dtype, size_t n, int divisor) {
  using c10::ScalarType;
  switch (dtype) {
    case ScalarType::Float:
      return divide<float, float>(data, n, static_cast<float>(divisor));
    case ScalarType::Double:
      return divide<double, double>(data, n, divisor);
    case ScalarType::Half:
      return divide<c10::Half, float>(data, n, static_cast<float>(divisor));
    case ScalarType::BFloat16:
      return divide<c10::BFloat16, float>(data, n, static_cast<float>(divisor));
    case ScalarType::ComplexFloat:
      return divide<c10::complex<float>, c10::complex<float>>(data, n,
                                                              c10::complex<float>(divisor, 0));
    case ScalarType::ComplexDouble:
      return divide<c10::complex<double>, c10::complex<double>>(data, n,
                                                                c10::complex<double>(divisor, 0));
    default:
      TDIST_THROW(InvalidArgument, "AVG is not supported for dtype ", c10::toString(dtype));
  }
}

}  // namespace tdist::comm::detail
