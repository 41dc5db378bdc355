// safetensors files (Note [safetensors format]): round trips, every malformed header rule, a
// fuzz-like pass over mutated files, a plain module's save and load, and both directions with
// Python's safetensors package.
#include "tdist/fsdp/safetensors.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <fstream>
#include <random>

#include "tdist/core/error.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/harness/command.h"
#include "tests/harness/process.h"

namespace tdist::test {
namespace {

using fsdp::NamedTensors;

// The tensors both this test and safetensors_interop.py build (the same recipe in each).
NamedTensors recipe() {
  auto ar = [](int64_t n) { return torch::arange(n, torch::kDouble); };
  NamedTensors t;
  t.emplace_back("f32", (ar(6) * 0.5 - 1).to(torch::kFloat).view({2, 3}));
  t.emplace_back("f64", (ar(4) * 0.5 - 1).view({4}));
  t.emplace_back("f16", (ar(6) * 0.5 - 1).to(torch::kHalf).view({3, 2}));
  t.emplace_back("bf16", (ar(5) * 0.5 - 1).to(torch::kBFloat16));
  t.emplace_back("i64", (ar(4) - 2).to(torch::kLong).view({2, 2}));
  t.emplace_back("i32", (ar(3) - 2).to(torch::kInt));
  t.emplace_back("i16", (ar(2) - 2).to(torch::kShort));
  t.emplace_back("i8", (ar(4) - 2).to(torch::kChar));
  t.emplace_back("u8", ar(6).to(torch::kByte));
  t.emplace_back("bool", (ar(5).to(torch::kLong) % 2 == 1));
  t.emplace_back("scalar", torch::tensor(2.5f));
  t.emplace_back("empty", torch::zeros({0, 3}));
  return t;
}

void expect_same(const NamedTensors& got, const NamedTensors& want) {
  ASSERT_EQ(got.size(), want.size());
  std::map<std::string, torch::Tensor> by_name(got.begin(), got.end());
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(by_name.count(name)) << name;
    const auto& g = by_name[name];
    EXPECT_EQ(g.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(g.sizes(), t.sizes()) << name;
    EXPECT_TRUE(torch::equal(g, t)) << name;
  }
}

std::string encode_header(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  return out + json + data;
}

TEST(Safetensors, RoundTripEveryDtypeWithMetadata) {
  const auto dir = temp_dir();
  const auto t = recipe();
  fsdp::save_safetensors(dir + "/a.safetensors", t, {{"format", "pt"}, {"by", "tdist"}});
  expect_same(fsdp::load_safetensors(dir + "/a.safetensors"), t);
  fsdp::SafetensorsReader reader(dir + "/a.safetensors");
  EXPECT_EQ(reader.header().metadata.at("by"), "tdist");
  EXPECT_EQ(reader.header().data_offset % 8, 0u);
  // A part of a tensor, flattened.
  EXPECT_TRUE(
      torch::equal(reader.read_elements("f32", 2, 3), t[0].second.reshape({-1}).narrow(0, 2, 3)));
  EXPECT_THROW(reader.read_elements("f32", 4, 3), InvalidArgument);
  EXPECT_THROW(reader.read("absent"), Error);
}

TEST(Safetensors, WriterRefusesBadInput) {
  EXPECT_THROW(fsdp::encode_safetensors({{"a", torch::zeros({1})}, {"a", torch::zeros({1})}}),
               InvalidArgument);
  EXPECT_THROW(fsdp::encode_safetensors({{"", torch::zeros({1})}}), InvalidArgument);
  EXPECT_THROW(fsdp::encode_safetensors({{"c", torch::zeros({1}, torch::kComplexFloat)}}),
               InvalidArgument);
}

struct Malformed {
  const char* what;
  std::string file;
  const char* message;
};

TEST(Safetensors, MalformedHeadersAreRefusedClearly) {
  const std::string f32x2 = R"("dtype":"F32","shape":[2])";
  const std::string d8(8, '\1');
  std::string huge(8, '\0');
  const uint64_t big = uint64_t(1) << 40;
  std::memcpy(huge.data(), &big, 8);
  const std::vector<Malformed> cases = {
      {"short", "1234", "fewer than the 8"},
      {"huge length", huge + "{}", "exceeds 100000000"},
      {"length past the end", encode_header("{}", "").substr(0, 8) + "{", "exceeds the 1 bytes"},
      {"not JSON", encode_header("{\"a\":", ""), "not valid JSON"},
      {"not an object", encode_header("[1,2]", ""), "does not start with '{'"},
      {"entry not object", encode_header(R"({"a":3})", ""), "'a' is not an object"},
      {"no dtype", encode_header(R"({"a":{"shape":[0],"data_offsets":[0,0]}})", ""), "no dtype"},
      {"bad dtype", encode_header(R"({"a":{"dtype":"F33","shape":[0],"data_offsets":[0,0]}})", ""),
       "unknown dtype 'F33'"},
      {"unknown field",
       encode_header(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0],"x":1}})", ""),
       "unknown field 'x'"},
      {"negative dim",
       encode_header(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})", ""),
       "not a non-negative integer"},
      {"shape overflows",
       encode_header(
           R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", ""),
       "overflows"},
      {"offsets not a pair", encode_header("{\"a\":{" + f32x2 + R"(,"data_offsets":[0]}})", d8),
       "not a pair"},
      {"end before begin", encode_header("{\"a\":{" + f32x2 + R"(,"data_offsets":[8,0]}})", d8),
       "end before they begin"},
      {"past the data", encode_header("{\"a\":{" + f32x2 + R"(,"data_offsets":[0,16]}})", d8),
       "go past the data's 8 bytes"},
      {"length mismatch",
       encode_header(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", d8), "needs 12"},
      {"overlap",
       encode_header("{\"a\":{" + f32x2 + R"(,"data_offsets":[0,8]},"b":{)" + f32x2 +
                         R"(,"data_offsets":[4,12]}})",
                     d8 + "1234"),
       "overlaps"},
      {"hole", encode_header("{\"a\":{" + f32x2 + R"(,"data_offsets":[4,12]}})", d8 + "1234"),
       "belong to no tensor"},
      {"unindexed tail", encode_header("{\"a\":{" + f32x2 + R"(,"data_offsets":[0,8]}})", d8 + "x"),
       "the file holds 9"},
      {"duplicate name",
       encode_header("{\"a\":{" + f32x2 + R"(,"data_offsets":[0,8]},"a":{)" + f32x2 +
                         R"(,"data_offsets":[0,8]}})",
                     d8),
       "'a' appears twice"},
      {"metadata not strings", encode_header(R"({"__metadata__":{"k":1}})", ""), "is not a string"},
      {"too deep", encode_header(R"({"a":{"dtype":"F32","shape":[[1]],"data_offsets":[0,4]}})", ""),
       "nested deeper"},
      {"empty name", encode_header("{\"\":{" + f32x2 + R"(,"data_offsets":[0,8]}})", d8),
       "empty name"},
  };
  const auto dir = temp_dir();
  for (const auto& c : cases) {
    try {
      fsdp::parse_safetensors(c.file.data(), c.file.size());
      ADD_FAILURE() << c.what << ": accepted";
    } catch (const ProtocolError& e) {
      EXPECT_NE(std::string(e.what()).find(c.message), std::string::npos)
          << c.what << ": " << e.what();
    }
    // The file reader says the same, naming the file.
    const std::string path = dir + "/bad.safetensors";
    std::ofstream(path, std::ios::binary | std::ios::trunc) << c.file;
    try {
      fsdp::SafetensorsReader reader(path);
      ADD_FAILURE() << c.what << ": the reader accepted it";
    } catch (const ProtocolError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(fsdp::SafetensorsReader(dir + "/absent.safetensors"), Error);
}

// Mutated and truncated copies of a valid file: each either parses into entries that lie inside
// the data (and then reads) or throws ProtocolError; nothing else (no crash, no other error).
TEST(Safetensors, FuzzedHeadersParseOrFailCleanly) {
  const std::string good = fsdp::encode_safetensors(recipe(), {{"k", "v"}});
  uint64_t header_len = 0;
  std::memcpy(&header_len, good.data(), 8);
  std::mt19937_64 rng(42);
  int accepted = 0;
  int refused = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string f = good;
    switch (i % 4) {
      case 0:  // a few bytes of the header changed
      case 1:
        for (int k = 0; k < 1 + i % 3; ++k) {
          f[8 + rng() % header_len] = static_cast<char>(" {}[]\",:0123456789eE-.aFIU"[rng() % 26]);
        }
        break;
      case 2:  // truncated
        f.resize(rng() % f.size());
        break;
      case 3: {  // another header length
        const uint64_t n = rng() % (f.size() + 16);
        std::memcpy(f.data(), &n, 8);
        break;
      }
    }
    try {
      const auto h = fsdp::parse_safetensors(f.data(), f.size());
      ++accepted;
      for (const auto& e : h.tensors) {
        ASSERT_LE(e.end, f.size() - h.data_offset);
        ASSERT_EQ(e.end - e.begin, static_cast<uint64_t>(e.numel()) * at::elementSize(e.dtype));
      }
    } catch (const ProtocolError&) {
      ++refused;
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(accepted, 0);  // some mutations keep a valid file (a space, a digit in metadata)
}

TEST(Safetensors, PlainModuleSaveAndLoad) {
  const auto dir = temp_dir();
  torch::manual_seed(3);
  Net a;
  a->register_buffer("stat", torch::tensor({1.5, -2.0}));
  fsdp::save_safetensors(*a, dir + "/net.safetensors");
  torch::manual_seed(4);
  Net b;
  b->register_buffer("stat", torch::zeros({2}));
  fsdp::load_safetensors(*b, dir + "/net.safetensors");
  EXPECT_EQ(max_abs_diff(values_of(*a), values_of(*b)), 0.0);
  EXPECT_TRUE(torch::equal(b->named_buffers()["stat"], torch::tensor({1.5, -2.0})));

  // A module that does not match: every difference listed, nothing loaded.
  Net c;  // no buffer: the file's "stat" is extra
  const auto before = values_of(*c);
  try {
    fsdp::load_safetensors(*c, dir + "/net.safetensors");
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("not in the module: stat"), std::string::npos) << e.what();
  }
  EXPECT_EQ(max_abs_diff(values_of(*c), before), 0.0);
  fsdp::save_safetensors(dir + "/wrong.safetensors",
                         {{"fc1.weight", torch::zeros({7, 5})}, {"fc1.bias", torch::zeros({7})}});
  try {
    fsdp::load_safetensors(*c, dir + "/wrong.safetensors");
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("fc1.weight: the file has F32 [7, 5]"), std::string::npos) << m;
    EXPECT_NE(m.find("missing: fc3.weight"), std::string::npos) << m;
  }
  EXPECT_EQ(max_abs_diff(values_of(*c), before), 0.0);
}

// Both directions with Python's safetensors package (a pip test dependency; scripts/setup.sh).
TEST(Safetensors, InteroperatesWithPythonSafetensors) {
  const std::string python = TDIST_TEST_PYTHON;
  const auto probe = run_command({python, "-c", "import safetensors.torch"}, with_timeout(60));
  if (!probe.exited || probe.exit_code != 0) {
    GTEST_SKIP() << "Python's safetensors package is missing for " << python
                 << " (pip install safetensors; scripts/setup.sh installs it): " << probe.err;
  }
  const auto dir = temp_dir();
  fsdp::save_safetensors(dir + "/cpp.safetensors", recipe(), {{"written_by", "tdist"}});
  torch::manual_seed(5);
  Net net;
  fsdp::save_safetensors(*net, dir + "/cpp_model.safetensors");
  const auto r =
      run_command({python, std::string(TDIST_FSDP_TEST_DIR) + "/safetensors_interop.py", dir},
                  with_timeout(120, {{"OMP_NUM_THREADS", "1"}}));
  ASSERT_TRUE(r.exited && r.exit_code == 0) << r.describe();
  EXPECT_NE(r.out.find("C++ file equals the recipe"), std::string::npos) << r.describe();

  // Python saved the recipe, and the model's tensors doubled.
  expect_same(fsdp::load_safetensors(dir + "/py.safetensors"), recipe());
  Net loaded;
  fsdp::load_safetensors(*loaded, dir + "/py_model.safetensors");
  auto want = values_of(*net);
  for (auto& t : want) t = t * 2;
  EXPECT_EQ(max_abs_diff(values_of(*loaded), want), 0.0);
}

}  // namespace
}  // namespace tdist::test
