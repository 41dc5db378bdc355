#pragma once
// Reduction kernels: out[i] = a[i] op b[i] over raw element pointers, one vectorizable loop per
// (dtype, op). `out` may alias `a` (in-place accumulation). float16/bfloat16 are computed in
// float32 and rounded once per element. Bool: SUM/MAX/BOR are logical or, PRODUCT/MIN/BAND
// logical and, BXOR exclusive or. Complex: SUM, PRODUCT and AVG only. Floating-point MIN/MAX
// propagate NaN like torch.minimum/maximum and are commutative bit for bit (Note [MIN/MAX
// semantics] in reduce_kernels.cpp), so every rank of a collective ends bit-identical.
//
// Thread safety: pure functions.

#include <c10/core/ScalarType.h>

#include <cstddef>

#include "tdist/comm/types.h"

namespace tdist::comm::detail {

using ReduceFn = void (*)(void* out, const void* a, const void* b, size_t n);

// The kernel for (dtype, op); AVG gives the SUM kernel (divide with scale_for_avg at the end).
// Throws InvalidArgument naming the pair when it is not supported.
ReduceFn reduce_kernel(c10::ScalarType dtype, ReduceOp op);

// Whether (dtype, op) is supported (no throw).
bool reduce_supported(c10::ScalarType dtype, ReduceOp op);

// data[i] /= divisor for floating-point and complex dtypes (AVG's final step).
void divide_in_place(void* data, c10::ScalarType dtype, size_t n, int divisor);

}  // namespace tdist::comm::detail
