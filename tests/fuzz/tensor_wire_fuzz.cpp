// Fuzzes the tensor wire format (core/tensor_wire.h) as core/serialize.h's archive reads it: a
// tensor written inline (its TensorMeta, then its bytes) alone, in a vector, or among other
// fields; and validate_tensor_meta against a byte count that the input names. The first byte
// picks the mode. Any input must give a tensor or a ProtocolError, never a crash, a sanitizer
// report or an allocation that the input's bytes do not pay for. A tensor that decodes must
// describe itself as its metadata said and encode back to exactly the bytes it came from.
//
// TDIST_FUZZ_WRITE_SEEDS=<dir> fuzz_tensor_wire writes the seed corpus (tensors encoded by the
// library's encoder, one file per mode) into <dir> and exits.
#include <c10/util/accumulate.h>

#include <ATen/ops/arange.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scalar_tensor.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "tdist/core/error.h"
#include "tdist/core/serialize.h"
#include "tdist/core/tensor_wire.h"
#include "tests/fuzz/fuzz_files.h"

namespace {

void check(bool ok) {
  if (!ok) std::abort();
}

// The metadata a decoded tensor reports must be the metadata it was decoded from.
void check_described(const at::Tensor& t) {
  const tdist::TensorMeta m = tdist::describe_tensor(t);
  check(static_cast<uint64_t>(t.nbytes()) == m.nbytes);
}

// Decodes a T; when it decodes, encoding it again must give the same bytes.
template <class T>
void round_trip(const uint8_t* data, size_t size) {
  T value = tdist::decode<T>(data, size);
  const tdist::Bytes again = tdist::encode(value);
  check(again.size() == size && (size == 0 || std::memcmp(again.data(), data, size) == 0));
  if constexpr (std::is_same_v<T, at::Tensor>) {
    check_described(value);
  } else {
    for (const at::Tensor& t : value) check_described(t);
  }
}

using tdist::fuzz::write_seed;

void write_seeds(const std::string& dir) {
  const at::Tensor matrix = at::arange(6, at::kFloat).reshape({2, 3});
  write_seed(dir + "/tensor_float_2x3", 0, tdist::encode(matrix));
  write_seed(dir + "/tensor_long_scalar", 0, tdist::encode(at::scalar_tensor(7, at::kLong)));
  write_seed(dir + "/tensor_bool_0x4", 0, tdist::encode(at::ones({0, 4}, at::kBool)));
  write_seed(dir + "/tensor_view_transposed", 0, tdist::encode(matrix.t()));
  write_seed(dir + "/vector", 1,
             tdist::encode(std::vector<at::Tensor>{at::ones({2}, at::kComplexFloat),
                                                   at::arange(5, at::kByte),
                                                   at::ones({1, 1, 1}, at::kHalf)}));
  write_seed(
      dir + "/fields", 2,
      tdist::encode(
          std::string("w"),
          std::map<std::string, at::Tensor>{{"a", matrix}, {"b", at::ones({3}, at::kDouble)}},
          std::optional<at::Tensor>(at::arange(3, at::kInt)), std::vector<int64_t>{1, 2}));
  const tdist::TensorMeta meta = tdist::describe_tensor(matrix);
  tdist::Bytes checked = tdist::encode(meta, uint64_t{24});
  checked.insert(checked.end(), static_cast<const uint8_t*>(matrix.data_ptr()),
                 static_cast<const uint8_t*>(matrix.data_ptr()) + 24);
  write_seed(dir + "/meta_available_bytes", 3, checked);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tdist::fuzz::write_seeds_if_asked(write_seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  ++data;
  --size;
  try {
    switch (mode % 4) {
      case 0:
        round_trip<at::Tensor>(data, size);
        break;
      case 1:
        round_trip<std::vector<at::Tensor>>(data, size);
        break;
      case 2: {  // a tensor among other fields (collections of them, an optional one)
        using Fields = std::tuple<std::string, std::map<std::string, at::Tensor>,
                                  std::optional<at::Tensor>, std::vector<int64_t>>;
        const auto fields = tdist::decode<Fields>(data, size);
        for (const auto& [name, t] : std::get<1>(fields)) check_described(t);
        if (std::get<2>(fields)) check_described(*std::get<2>(fields));
        break;
      }
      default: {  // metadata, then a byte count to check it against, then the bytes
        tdist::BoundedInputArchive ar(data, size);
        tdist::TensorMeta meta;
        uint64_t available = 0;
        try {
          ar(meta, available);
        } catch (const cereal::Exception& e) {
          throw tdist::ProtocolError(e.what());
        }
        tdist::validate_tensor_meta(meta, available);
        // Valid metadata: its byte count is what its shape and dtype make (no overflow).
        const uint64_t elem = c10::elementSize(static_cast<c10::ScalarType>(meta.dtype));
        check(c10::multiply_integers(meta.shape) * elem == meta.nbytes);
        if (meta.nbytes <= ar.remaining()) {
          const at::Tensor t = tdist::tensor_from_bytes(meta, ar.take(meta.nbytes), meta.nbytes);
          check(t.sizes().vec() == meta.shape && static_cast<uint64_t>(t.nbytes()) == meta.nbytes);
          check_described(t);
        }
        break;
      }
    }
  } catch (const tdist::ProtocolError&) {}
  return 0;
}
