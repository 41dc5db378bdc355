#include "tdist/fsdp/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <torch/nn/module.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "tdist/core/atomic_file.h"
#include "tdist/core/error.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little endian; this host is not (Note [safetensors format])");

namespace tdist::fsdp {
namespace {

using json = nlohmann::json;

struct DtypeName {
  const char* name;
  at::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"F64", at::kDouble},
    {"F32", at::kFloat},
    {"F16", at::kHalf},
    {"BF16", at::kBFloat16},
    {"I64", at::kLong},
    {"I32", at::kInt},
    {"I16", at::kShort},
    {"I8", at::kChar},
    {"U8", at::kByte},
    {"BOOL", at::kBool},
    {"F8_E4M3", at::kFloat8_e4m3fn},
    {"F8_E5M2", at::kFloat8_e5m2},
};

// The entries a tensor's header object must have, and no others.
constexpr const char* kEntryKeys[] = {"dtype", "shape", "data_offsets"};
constexpr int kMaxJsonDepth = 3;  // {"name": {"shape": [...]}}

[[noreturn]] void malformed(const std::string& what) {
  throw ProtocolError("malformed safetensors header: " + what);
}

at::ScalarType dtype_of(const json& v, const std::string& name) {
  if (!v.is_string()) malformed("tensor '" + name + "': dtype is not a string");
  const auto& s = v.get_ref<const std::string&>();
  for (const auto& d : kDtypes) {
    if (s == d.name) return d.type;
  }
  malformed("tensor '" + name + "': unknown dtype '" + s + "'");
}

uint64_t unsigned_of(const json& v, const std::string& name, const char* field) {
  if (!v.is_number_unsigned()) {
    malformed(tdist::str("tensor '", name, "': ", field, " holds ", v.dump(),
                         ", not a non-negative integer"));
  }
  return v.get<uint64_t>();
}

SafetensorsEntry entry_of(const std::string& name, const json& v, uint64_t data_bytes) {
  if (name.empty()) malformed("a tensor has an empty name");
  if (!v.is_object()) malformed("tensor '" + name + "' is not an object");
  for (const auto& item : v.items()) {
    if (std::none_of(std::begin(kEntryKeys), std::end(kEntryKeys),
                     [&](const char* k) { return item.key() == k; })) {
      malformed("tensor '" + name + "' has an unknown field '" + item.key() + "'");
    }
  }
  for (const char* k : kEntryKeys) {
    if (!v.contains(k)) malformed(tdist::str("tensor '", name, "' has no ", k));
  }
  SafetensorsEntry e;
  e.name = name;
  e.dtype = dtype_of(v["dtype"], name);
  const json& shape = v["shape"];
  if (!shape.is_array()) malformed("tensor '" + name + "': shape is not an array");
  if (shape.size() > kMaxDims) {
    malformed(
        tdist::str("tensor '", name, "' has ", shape.size(), " dimensions, more than ", kMaxDims));
  }
  uint64_t bytes = at::elementSize(e.dtype);
  for (const json& d : shape) {
    const uint64_t n = unsigned_of(d, name, "shape");
    if (n > static_cast<uint64_t>(INT64_MAX) || __builtin_mul_overflow(bytes, n, &bytes) ||
        bytes > static_cast<uint64_t>(INT64_MAX)) {
      malformed("tensor '" + name + "': its shape " + shape.dump() + " overflows");
    }
    e.shape.push_back(static_cast<int64_t>(n));
  }
  const json& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2) {
    malformed("tensor '" + name + "': data_offsets is not a pair [begin, end]");
  }
  e.begin = unsigned_of(off[0], name, "data_offsets");
  e.end = unsigned_of(off[1], name, "data_offsets");
  if (e.begin > e.end) {
    malformed(tdist::str("tensor '", name, "': data_offsets [", e.begin, ", ", e.end,
                         "] end before they begin"));
  }
  if (e.end > data_bytes) {
    malformed(tdist::str("tensor '", name, "': data_offsets [", e.begin, ", ", e.end,
                         "] go past the data's ", data_bytes, " bytes (a truncated file?)"));
  }
  if (e.end - e.begin != bytes) {
    malformed(tdist::str("tensor '", name, "': data_offsets [", e.begin, ", ", e.end, "] hold ",
                         e.end - e.begin, " bytes, but shape ", shape.dump(), " of ",
                         safetensors_dtype(e.dtype), " needs ", bytes));
  }
  return e;
}

int open_or_throw(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) TDIST_THROW(Error, "safetensors file '", path, "' does not exist");
    TDIST_THROW(Error, "cannot open safetensors file '", path, "': ", std::strerror(errno));
  }
  return fd;
}

}  // namespace

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const SafetensorsEntry* SafetensorsHeader::find(const std::string& name) const {
  for (const auto& e : tensors) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

std::string safetensors_dtype(at::ScalarType t) {
  for (const auto& d : kDtypes) {
    if (d.type == t) return d.name;
  }
  TDIST_THROW(InvalidArgument, "safetensors has no dtype for ", t);
}

SafetensorsHeader parse_safetensors_header(std::string_view text, uint64_t data_bytes) {
  if (text.empty() || text.front() != '{') malformed("it does not start with '{'");
  std::set<std::string> seen;
  std::string duplicate;
  bool too_deep = false;
  auto check = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1) {
      const auto& k = parsed.get_ref<const std::string&>();
      if (!seen.insert(k).second && duplicate.empty()) duplicate = k;
    }
    if ((event == json::parse_event_t::object_start || event == json::parse_event_t::array_start) &&
        depth >= kMaxJsonDepth) {
      too_deep = true;
      return false;
    }
    return true;
  };
  json root;
  try {
    root = json::parse(text.begin(), text.end(), check);
  } catch (const json::exception& e) {
    malformed(std::string("not valid JSON: ") + e.what());
  }
  if (too_deep) malformed(tdist::str("JSON nested deeper than ", kMaxJsonDepth, " levels"));
  if (!duplicate.empty()) malformed("name '" + duplicate + "' appears twice");
  if (!root.is_object()) malformed("not a JSON object");

  SafetensorsHeader h;
  h.data_offset = 8 + text.size();
  for (const auto& item : root.items()) {
    if (item.key() == "__metadata__") {
      if (!item.value().is_object()) malformed("__metadata__ is not an object");
      for (const auto& m : item.value().items()) {
        if (!m.value().is_string()) malformed("__metadata__ '" + m.key() + "' is not a string");
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    h.tensors.push_back(entry_of(item.key(), item.value(), data_bytes));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t at = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const auto& e : h.tensors) {
    if (e.begin < at) {
      malformed(tdist::str("tensor '", e.name, "' (bytes [", e.begin, ", ", e.end, ")) overlaps '",
                           previous->name, "' (bytes [", previous->begin, ", ", previous->end,
                           "))"));
    }
    if (e.begin > at) {
      malformed(tdist::str("bytes [", at, ", ", e.begin, ") of the data belong to no tensor"));
    }
    at = e.end;
    previous = &e;
  }
  if (at != data_bytes) {
    malformed(tdist::str("the tensors index ", at, " bytes of data, the file holds ", data_bytes));
  }
  return h;
}

SafetensorsHeader parse_safetensors(const void* bytes, size_t size) {
  if (size < 8)
    malformed(tdist::str("the file has ", size, " bytes, fewer than the 8 of its length"));
  uint64_t n = 0;
  std::memcpy(&n, bytes, 8);
  if (n > kMaxHeaderBytes) malformed(tdist::str("header length ", n, " exceeds ", kMaxHeaderBytes));
  if (n > size - 8) {
    malformed(tdist::str("header length ", n, " exceeds the ", size - 8, " bytes after it"));
  }
  const char* p = static_cast<const char*>(bytes) + 8;
  return parse_safetensors_header(std::string_view(p, n), size - 8 - n);
}

std::string encode_safetensors(const NamedTensors& tensors,
                               const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    TDIST_CHECK_ARG(!name.empty(), "safetensors: a tensor needs a name");
    TDIST_CHECK_ARG(name != "__metadata__" && !header.contains(name), "safetensors: the name '",
                    name, "' is used twice (or reserved)");
    TDIST_CHECK_ARG(t.defined(), "safetensors: tensor '", name, "' is undefined");
    at::Tensor host = t.detach().to(at::kCPU).contiguous();
    const uint64_t bytes = static_cast<uint64_t>(host.numel()) * host.element_size();
    header[name] = {{"dtype", safetensors_dtype(host.scalar_type())},
                    {"shape", host.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(std::move(host));
  }
  std::string text = header.dump();
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::string out(8, '\0');
  const uint64_t n = text.size();
  std::memcpy(out.data(), &n, 8);
  out.reserve(8 + text.size() + offset);
  out += text;
  for (const auto& t : data) {
    out.append(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
  }
  return out;
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const std::string bytes = encode_safetensors(tensors, metadata);
  write_file_atomically(path, {std::string_view(bytes)});
}

NamedTensors load_safetensors(const std::string& path) {
  SafetensorsReader reader(path);
  NamedTensors out;
  for (const auto& e : reader.header().tensors) out.emplace_back(e.name, reader.read(e.name));
  return out;
}

SafetensorsReader::SafetensorsReader(std::string path) : path_(std::move(path)) {
  fd_ = open_or_throw(path_, O_RDONLY);
  try {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      TDIST_THROW(Error, "cannot stat '", path_, "': ", std::strerror(errno));
    }
    const auto size = static_cast<uint64_t>(st.st_size);
    try {
      if (size < 8)
        malformed(tdist::str("the file has ", size, " bytes, fewer than the 8 of its length"));
      uint64_t n = 0;
      read_exactly_at(fd_, &n, 8, 0, path_);
      if (n > kMaxHeaderBytes)
        malformed(tdist::str("header length ", n, " exceeds ", kMaxHeaderBytes));
      if (n > size - 8) {
        malformed(tdist::str("header length ", n, " exceeds the ", size - 8, " bytes after it"));
      }
      std::string text(n, '\0');
      read_exactly_at(fd_, text.data(), n, 8, path_);
      header_ = parse_safetensors_header(text, size - 8 - n);
    } catch (const ProtocolError& e) {
      throw ProtocolError(tdist::str("'", path_, "': ", e.what()));
    }
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

const SafetensorsEntry& SafetensorsReader::entry(const std::string& name) const {
  const SafetensorsEntry* e = header_.find(name);
  if (e == nullptr) TDIST_THROW(Error, "safetensors file '", path_, "' has no tensor '", name, "'");
  return *e;
}

at::Tensor SafetensorsReader::read(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  return read_elements(name, 0, e.numel()).view(e.shape);
}

at::Tensor SafetensorsReader::read_elements(const std::string& name, int64_t first,
                                            int64_t count) const {
  const SafetensorsEntry& e = entry(name);
  TDIST_CHECK_ARG(first >= 0 && count >= 0 && first <= e.numel() - count, "elements [", first, ", ",
                  first + count, ") are outside tensor '", name, "' of ", e.numel(), " in '", path_,
                  "'");
  at::Tensor out = at::empty({count}, at::TensorOptions().dtype(e.dtype));
  const uint64_t esize = at::elementSize(e.dtype);
  read_exactly_at(fd_, out.data_ptr(), static_cast<size_t>(count) * esize,
                  header_.data_offset + e.begin + static_cast<uint64_t>(first) * esize, path_);
  return out;
}

void save_safetensors(const torch::nn::Module& module, const std::string& path,
                      const std::map<std::string, std::string>& metadata) {
  NamedTensors tensors;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    tensors.emplace_back(item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    if (item.value().defined()) tensors.emplace_back(item.key(), item.value());
  }
  save_safetensors(path, tensors, metadata);
}

void load_safetensors(torch::nn::Module& module, const std::string& path) {
  SafetensorsReader reader(path);
  NamedTensors targets;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    targets.emplace_back(item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    if (item.value().defined()) targets.emplace_back(item.key(), item.value());
  }
  // Every difference is found before anything is changed.
  std::string problems;
  std::set<std::string> wanted;
  for (const auto& [name, t] : targets) {
    wanted.insert(name);
    const SafetensorsEntry* e = reader.header().find(name);
    if (e == nullptr) {
      problems += "\n  missing: " + name;
    } else if (e->shape != t.sizes().vec() || e->dtype != t.scalar_type()) {
      problems +=
          tdist::str("\n  ", name, ": the file has ", safetensors_dtype(e->dtype), " ",
                     c10::IntArrayRef(e->shape), ", the module ", t.scalar_type(), " ", t.sizes());
    }
  }
  for (const auto& e : reader.header().tensors) {
    if (!wanted.count(e.name)) problems += "\n  not in the module: " + e.name;
  }
  if (!problems.empty()) {
    throw InvalidArgument(
        tdist::str("'", path, "' does not match the module (nothing was loaded):", problems));
  }
  std::vector<at::Tensor> values;
  for (const auto& [name, t] : targets) values.push_back(reader.read(name));
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < targets.size(); ++i) targets[i].second.copy_(values[i]);
}

}  // namespace tdist::fsdp
