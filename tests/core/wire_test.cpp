#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <map>

#include "tdist/core/serialize.h"
#include "tdist/core/tensor_wire.h"
#include "tdist/core/wire.h"
#include "tests/harness/memory.h"

namespace tdist {
namespace {

TEST(Wire, RoundTripsIntegersAndStrings) {
  Bytes buf;
  wire::Writer w(buf);
  w.u8(7);
  w.u32(0xdeadbeef);
  w.i64(-5);
  w.string("hello");
  w.blob(to_bytes("xyz"));
  wire::Reader r(buf);
  EXPECT_EQ(r.u8(), 7);
  EXPECT_EQ(r.u32(), 0xdeadbeefu);
  EXPECT_EQ(r.i64(), -5);
  EXPECT_EQ(r.string(), "hello");
  EXPECT_EQ(to_string(r.blob()), "xyz");
  EXPECT_NO_THROW(r.expect_end());
}

TEST(Wire, LengthsAreCheckedBeforeAllocating) {
  Bytes buf;
  wire::Writer w(buf);
  w.u64(uint64_t(1) << 62);  // a forged length
  w.raw("abc", 3);
  wire::Reader r(buf);
  EXPECT_THROW(r.blob("payload"), ProtocolError);
  wire::Reader truncated(buf.data(), 4);
  EXPECT_THROW(truncated.u64(), ProtocolError);
}

TEST(TensorWire, RoundTripsEveryDtypeAndShape) {
  std::vector<at::ScalarType> dtypes = {at::kFloat, at::kDouble, at::kHalf,        at::kBFloat16,
                                        at::kInt,   at::kLong,   at::kByte,        at::kChar,
                                        at::kShort, at::kBool,   at::kComplexFloat};
  std::vector<std::vector<int64_t>> shapes = {{}, {0}, {1}, {3, 5}, {2, 0, 4}, {2, 3, 4, 5}};
  for (auto dt : dtypes) {
    for (const auto& shape : shapes) {
      at::Tensor t = torch::randn(shape).mul(10).to(dt);
      at::Tensor back = decode<at::Tensor>(encode(t));
      EXPECT_EQ(back.scalar_type(), dt);
      EXPECT_EQ(back.sizes(), t.sizes());
      EXPECT_TRUE(back.equal(t)) << dt;
    }
  }
}

TEST(TensorWire, NonContiguousIsSentAsContiguous) {
  at::Tensor t = torch::arange(12, torch::kFloat).reshape({3, 4}).t();
  EXPECT_TRUE(decode<at::Tensor>(encode(t)).equal(t));
}

// A conjugate or negative view shares its base's storage and carries a bit: what travels is the
// values the view shows.
TEST(TensorWire, ConjugateAndNegativeViewsAreSentAsTheirValues) {
  at::Tensor z =
      torch::complex(torch::arange(6, torch::kDouble), torch::arange(6, torch::kDouble) + 1);
  at::Tensor f = torch::arange(6, torch::kFloat) + 1;
  for (const at::Tensor& v :
       {z.conj(), f._neg_view(), z._neg_view(), z.conj().reshape({2, 3}).t()}) {
    ASSERT_TRUE(v.is_conj() || v.is_neg());
    at::Tensor want = v.resolve_conj().resolve_neg();
    at::Tensor back = decode<at::Tensor>(encode(v));
    EXPECT_FALSE(back.is_conj() || back.is_neg());
    EXPECT_TRUE(back.equal(want)) << back << " vs " << want;
  }
}

TEST(TensorWire, RejectsForgedMetadata) {
  TensorMeta m;
  m.dtype = static_cast<int8_t>(at::kFloat);
  m.shape = {4};
  m.nbytes = 16;
  EXPECT_NO_THROW(validate_tensor_meta(m, 16));
  EXPECT_THROW(validate_tensor_meta(m, 15), ProtocolError);  // not enough bytes
  m.nbytes = 12;
  EXPECT_THROW(validate_tensor_meta(m, 100), ProtocolError);  // does not match shape
  m.shape = {int64_t(1) << 40, int64_t(1) << 40};
  m.nbytes = 0;
  EXPECT_THROW(validate_tensor_meta(m, 100), ProtocolError);  // overflow
  m.shape = {-1};
  EXPECT_THROW(validate_tensor_meta(m, 100), ProtocolError);
  m.shape = {1};
  m.dtype = 99;
  m.nbytes = 4;
  EXPECT_THROW(validate_tensor_meta(m, 100), ProtocolError);  // unknown dtype
  m.dtype = static_cast<int8_t>(at::kFloat);
  m.shape.assign(65, 1);
  EXPECT_THROW(validate_tensor_meta(m, 100), ProtocolError);  // too many dims
}

// A zero dimension makes the byte count 0, but the other dimensions must still describe a shape
// at::empty can make: otherwise the receiver fails later with a non-protocol error.
TEST(TensorWire, EmptyShapesWithHugeDimensionsAreForged) {
  TensorMeta m;
  m.dtype = static_cast<int8_t>(at::kFloat);
  m.nbytes = 0;
  m.shape = {0, int64_t(1) << 62, int64_t(1) << 62};
  EXPECT_THROW(validate_tensor_meta(m, 0), ProtocolError);
  m.shape = {int64_t(1) << 62, 0};  // 2^62 floats = 2^64 bytes if it were not empty
  EXPECT_THROW(validate_tensor_meta(m, 0), ProtocolError);
  m.shape = {0, int64_t(1) << 20, 3};  // a real empty tensor
  EXPECT_NO_THROW(validate_tensor_meta(m, 0));
  uint8_t none = 0;
  EXPECT_EQ(tensor_from_bytes(m, &none, 0).sizes(), at::IntArrayRef({0, int64_t(1) << 20, 3}));
}

struct Sample {
  std::string name;
  std::vector<int64_t> ids;
  std::map<std::string, double> weights;
  std::optional<at::Tensor> tensor;
  template <class A>
  void serialize(A& ar) {
    ar(name, ids, weights, tensor);
  }
};

TEST(Serialize, CerealRoundTripWithTensor) {
  Sample s{"abc", {1, 2, 3}, {{"w", 0.5}}, torch::ones({2, 2})};
  Bytes b = encode(s);
  Sample back = decode<Sample>(b);
  EXPECT_EQ(back.name, "abc");
  EXPECT_EQ(back.ids, s.ids);
  EXPECT_EQ(back.weights, s.weights);
  ASSERT_TRUE(back.tensor.has_value());
  EXPECT_TRUE(back.tensor->equal(*s.tensor));
}

TEST(Serialize, ForgedCountIsRefusedBeforeResize) {
  // A std::vector<int64_t> whose count claims 2^62 elements.
  Bytes b;
  wire::Writer w(b);
  w.u64(uint64_t(1) << 62);
  w.i64(1);
  EXPECT_THROW(decode<std::vector<int64_t>>(b), ProtocolError);
  // A string whose length runs past the end.
  Bytes s;
  wire::Writer ws(s);
  ws.u64(100);
  ws.raw("ab", 2);
  EXPECT_THROW(decode<std::string>(s), ProtocolError);
  // Trailing garbage.
  Bytes ok = encode(std::string("x"));
  ok.push_back(0);
  EXPECT_THROW(decode<std::string>(ok), ProtocolError);
}

TEST(Serialize, LayoutIsCerealsBinaryLayoutOverWireH) {
  // The archive writes what wire::Writer writes field by field: numbers as they are, a string or
  // a vector as its u64 count and then its elements. Peers of older builds read it unchanged.
  Bytes expected;
  wire::Writer w(expected);
  w.string("ab");
  w.u32(7);
  w.u64(2);
  w.pod<int16_t>(1);
  w.pod<int16_t>(-2);
  w.u64(1);
  w.string("k");
  w.pod<double>(0.5);
  EXPECT_EQ(encode(std::string("ab"), uint32_t{7}, std::vector<int16_t>{1, -2},
                   std::map<std::string, double>{{"k", 0.5}}),
            expected);
}

TEST(Serialize, ForgedCountCostsNoMoreThanTheMessage) {
  // A collection count is checked as count * the fewest bytes an element takes on the wire
  // before the collection is resized: 2^40 strings announced in 20 bytes, and one string per
  // byte of a 4 MiB message (8 bytes each at least; resized first, they would take 128 MiB of
  // std::string), are ProtocolErrors, and the peak resident memory does not grow.
  Bytes small;
  wire::Writer ws(small);
  ws.u64(uint64_t{1} << 40);
  ws.raw("twelve bytes", 12);
  ASSERT_EQ(small.size(), 20u);
  const size_t n = size_t{4} << 20;
  Bytes big(8 + n, 0);  // the count, then zeros (as strings: empty ones, 8 bytes each)
  const uint64_t count = n;
  std::memcpy(big.data(), &count, sizeof(count));

  const long before = test::peak_rss_kib(true);
  EXPECT_THROW(decode<std::vector<std::string>>(small), ProtocolError);
  EXPECT_THROW(decode<std::vector<std::string>>(big), ProtocolError);
  EXPECT_THROW(decode<std::vector<std::vector<int64_t>>>(big), ProtocolError);
  EXPECT_THROW(decode<std::vector<int64_t>>(big), ProtocolError);
  const long after = test::peak_rss_kib(false);
  if (before < 0 || after < 0) GTEST_SKIP() << "no /proc/self/status here";
  EXPECT_LT(after - before, 8 * 1024) << "peak RSS grew from " << before << " KiB to " << after
                                      << " KiB decoding a " << big.size() / 1024 << " KiB message";
}

}  // namespace
}  // namespace tdist
