#pragma once
// Helpers shared by the comm tests: deterministic per-rank inputs and single-process references.

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"
#include "tdist/core/hash_store.h"
#include "tests/harness/env_guard.h"
#include "tests/harness/spawn.h"

namespace tdist::comm::test {

inline ProcessGroup::Options test_options(Millis timeout = Millis(60000)) {
  ProcessGroup::Options o;
  o.timeout = timeout;
  return o;
}

inline std::vector<c10::ScalarType> all_dtypes() {
  using c10::ScalarType;
  return {ScalarType::Byte,         ScalarType::Char,          ScalarType::Short,
          ScalarType::Int,          ScalarType::Long,          ScalarType::UInt16,
          ScalarType::UInt32,       ScalarType::UInt64,        ScalarType::Half,
          ScalarType::BFloat16,     ScalarType::Float,         ScalarType::Double,
          ScalarType::ComplexFloat, ScalarType::ComplexDouble, ScalarType::Bool};
}

inline std::vector<ReduceOp> all_ops() {
  return {ReduceOp::SUM, ReduceOp::AVG,  ReduceOp::PRODUCT, ReduceOp::MIN,
          ReduceOp::MAX, ReduceOp::BAND, ReduceOp::BOR,     ReduceOp::BXOR};
}

inline bool op_supported(c10::ScalarType t, ReduceOp op) {
  bool is_int = c10::isIntegralType(t, /*includeBool=*/false);
  bool is_bool = t == c10::ScalarType::Bool;
  bool is_complex = c10::isComplexType(t);
  bool bitwise = op == ReduceOp::BAND || op == ReduceOp::BOR || op == ReduceOp::BXOR;
  if (bitwise) return is_int || is_bool;
  if (op == ReduceOp::AVG) return !is_int && !is_bool;
  if (op == ReduceOp::MIN || op == ReduceOp::MAX) return !is_complex;
  return true;
}

// Small integer-valued inputs, so that every reduction is exact in every dtype (PRODUCT uses
// 1 and 2 only: powers of two; integer wrap-around is the same as the reference's modular one).
inline at::Tensor make_input(c10::ScalarType t, ReduceOp op, int64_t n, int rank, int seed = 0) {
  auto i = torch::arange(n, torch::kLong);
  at::Tensor v;
  if (op == ReduceOp::PRODUCT) {
    v = (i * 7 + rank * 3 + seed) % 2 + 1;
  } else if (op == ReduceOp::BAND || op == ReduceOp::BOR || op == ReduceOp::BXOR) {
    v = (i * 5 + rank * 11 + seed) % 16;
  } else if (c10::isSignedType(t) || c10::isFloatingType(t) || c10::isComplexType(t)) {
    v = (i * 7 + rank * 13 + seed) % 7 - 3;
  } else {
    v = (i * 7 + rank * 13 + seed) % 7;
  }
  if (t == c10::ScalarType::Bool) return (v % 2 != 0);
  if (c10::isComplexType(t)) {
    auto im = (i * 3 + rank + seed) % 3 - 1;
    if (op == ReduceOp::PRODUCT) im = torch::zeros_like(im);
    return torch::complex(v.to(torch::kDouble), im.to(torch::kDouble)).to(t);
  }
  return v.to(t);
}

// The reduction of `inputs` (one per rank) computed in one process in a wide dtype.
inline at::Tensor reference(const std::vector<at::Tensor>& inputs, ReduceOp op) {
  auto t = inputs[0].scalar_type();
  const int64_t n = static_cast<int64_t>(inputs.size());
  std::vector<at::Tensor> wide;
  auto wide_type = c10::isComplexType(t)    ? torch::kComplexDouble
                   : c10::isFloatingType(t) ? torch::kDouble
                                            : torch::kLong;
  for (auto& x : inputs) wide.push_back(x.to(wide_type));
  auto s = torch::stack(wide);
  at::Tensor r;
  if (t == c10::ScalarType::Bool) {
    switch (op) {
      case ReduceOp::SUM:
      case ReduceOp::MAX:
      case ReduceOp::BOR:
        r = s.amax(0);
        break;
      case ReduceOp::PRODUCT:
      case ReduceOp::MIN:
      case ReduceOp::BAND:
        r = s.amin(0);
        break;
      default:
        r = s.sum(0) % 2;
        break;
    }
    return r.to(t);
  }
  switch (op) {
    case ReduceOp::SUM:
      r = s.sum(0);
      break;
    case ReduceOp::AVG:
      r = s.sum(0) / static_cast<double>(n);
      break;
    case ReduceOp::PRODUCT:
      r = s.prod(0);
      break;
    case ReduceOp::MIN:
      r = s.amin(0);
      break;
    case ReduceOp::MAX:
      r = s.amax(0);
      break;
    case ReduceOp::BAND:
    case ReduceOp::BOR:
    case ReduceOp::BXOR: {
      r = wide[0].clone();
      for (size_t k = 1; k < wide.size(); ++k) {
        r = op == ReduceOp::BAND  ? r.bitwise_and(wide[k])
            : op == ReduceOp::BOR ? r.bitwise_or(wide[k])
                                  : r.bitwise_xor(wide[k]);
      }
      break;
    }
  }
  return r.to(t);
}

// The reduction of every rank's make_input(t, op, n, rank, seed) over `world` ranks.
inline at::Tensor expected(c10::ScalarType t, ReduceOp op, int64_t n, int world, int seed = 0) {
  std::vector<at::Tensor> all;
  for (int r = 0; r < world; ++r) all.push_back(make_input(t, op, n, r, seed));
  return reference(all, op);
}

// Compares after widening (some dtypes, e.g. uint32, lack comparison kernels).
inline bool same(const at::Tensor& got, const at::Tensor& want) {
  if (got.scalar_type() != want.scalar_type() || got.sizes() != want.sizes()) return false;
  auto t = got.scalar_type();
  if (c10::isComplexType(t) || c10::isFloatingType(t)) {
    auto wt = c10::isComplexType(t) ? torch::kComplexDouble : torch::kDouble;
    double rtol = (t == c10::ScalarType::Half || t == c10::ScalarType::BFloat16) ? 1e-2 : 1e-6;
    return torch::allclose(got.to(wt), want.to(wt), rtol, 1e-6);
  }
  return torch::equal(got.to(torch::kLong), want.to(torch::kLong));
}

inline std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << t.to(c10::isComplexType(t.scalar_type()) ? torch::kComplexDouble : torch::kDouble)
            .reshape({-1})
            .slice(0, 0, 16);
  return os.str();
}

}  // namespace tdist::comm::test
