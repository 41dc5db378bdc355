#pragma once
// safetensors files (the format of Hugging Face's `safetensors` package): write and read them,
// for named tensors, a plain torch::nn::Module, and (fsdp/checkpoint.h) a FullyShardedModule.
//
// Note [safetensors format]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A file is: N (8 bytes, unsigned little endian), N bytes of a JSON object (the header), then
// the data. Each header entry but "__metadata__" names a tensor:
//   "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}
// with [begin, end) a byte range of the data (offsets from its start), end - begin = the
// elements of `shape` times the dtype's size, in C order, little endian. "__metadata__", when
// present, maps strings to strings. What this reader accepts, checked before anything is
// allocated from the file's numbers (Reliability rules: bad input gets a clear error):
//  - at least 8 bytes; N at most kMaxHeaderBytes and at most the bytes after the 8; the header
//    a JSON object (starting with '{'), each name once, no empty name;
//  - each entry exactly dtype (one of the names below), shape (non-negative integers, at most
//    kMaxDims, their product fits in 63 bits) and data_offsets (two integers, begin <= end);
//  - end - begin equals the shape's bytes; the ranges, sorted, start at 0, neither overlap nor
//    leave holes, and the last ends where the file ends (the format's own rule: the data is
//    indexed entirely).
// Anything else throws ProtocolError naming the entry and what is wrong with it. The writer
// puts the tensors back to back in the order given and pads the header with spaces so that the
// data starts at a multiple of 8 bytes (what the Python package does). dtypes: F64 F32 F16
// BF16 I64 I32 I16 I8 U8 BOOL F8_E4M3 F8_E5M2 (torch's float8_e4m3fn and float8_e5m2). This
// host must be little endian (checked at compile time).
//
// Files are written atomically (tdist/core/atomic_file.h). Plain functions, blocking (file I/O);
// SafetensorsReader is not thread safe.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}

namespace tdist::fsdp {

inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the Python package's limit
inline constexpr size_t kMaxDims = 64;

struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte range in the data (after the header)
  uint64_t end = 0;
  int64_t numel() const;
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;  // in the order of their data
  std::map<std::string, std::string> metadata;
  uint64_t data_offset = 0;  // where the data starts in the file: 8 + N
  // The entry named `name`, or nullptr.
  const SafetensorsEntry* find(const std::string& name) const;
};

// Parses and checks a header (Note [safetensors format]): `json` is the N bytes after the
// length, `data_bytes` how many bytes follow them in the file. Throws ProtocolError.
SafetensorsHeader parse_safetensors_header(std::string_view json, uint64_t data_bytes);
// The same from a whole file's bytes (the length prefix first).
SafetensorsHeader parse_safetensors(const void* bytes, size_t size);

// The dtype's name in the format ("F32", ...); throws InvalidArgument for a dtype it lacks.
std::string safetensors_dtype(at::ScalarType t);

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// The file's bytes: length, header, data (each tensor copied to the host, contiguous).
// Throws InvalidArgument for a duplicate or empty name or a dtype the format lacks.
std::string encode_safetensors(const NamedTensors& tensors,
                               const std::map<std::string, std::string>& metadata = {});
// encode_safetensors, written atomically to `path`.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});
// Every tensor of the file (host tensors, in data order). Throws Error when the file is
// missing or unreadable and ProtocolError when it is malformed (naming the file).
NamedTensors load_safetensors(const std::string& path);

// An open file whose header was read and checked; tensors or parts of them are read on demand
// (only the bytes asked for). Not thread safe.
class SafetensorsReader {
 public:
  // Throws Error (missing, unreadable) or ProtocolError (malformed), naming `path`.
  explicit SafetensorsReader(std::string path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  // The entry named `name`; throws Error naming the file when it has none.
  const SafetensorsEntry& entry(const std::string& name) const;
  // The whole tensor (on the host).
  at::Tensor read(const std::string& name) const;
  // Elements [first, first + count) of the tensor, flattened in C order (a 1-D host tensor).
  at::Tensor read_elements(const std::string& name, int64_t first, int64_t count) const;

 private:
  std::string path_;
  int fd_ = -1;
  SafetensorsHeader header_;
};

// A module's parameters and buffers by their names (module.named_parameters() and
// named_buffers(), recursive), written by this process.
void save_safetensors(const torch::nn::Module& module, const std::string& path,
                      const std::map<std::string, std::string>& metadata = {});
// Loads every parameter and buffer of `module` from the file, which must hold exactly those
// names with the same shapes and dtypes (converted to the module's devices). Any mismatch
// throws InvalidArgument listing the differences, and the module is left unchanged.
void load_safetensors(torch::nn::Module& module, const std::string& path);

}  // namespace tdist::fsdp
