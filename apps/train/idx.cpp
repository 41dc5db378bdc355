#include "apps/train/idx.h"

#include <ATen/ATen.h>
#include <sys/stat.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <vector>

#include "apps/train/models.h"

namespace tdist::train {
namespace {

constexpr uint8_t kUnsignedByte = 0x08;
// MNIST's training-set pixel mean and standard deviation (of values scaled to [0, 1]).
constexpr double kMnistMean = 0.1307;
constexpr double kMnistStd = 0.3081;

uint32_t big_endian_u32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

}  // namespace

at::Tensor read_idx_ubyte(const std::string& path, int ndim) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw DataError(str("cannot read '", path, "': ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) throw DataError(str("'", path, "' is not a regular file"));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(str("cannot open '", path, "'"));
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);

  std::array<uint8_t, 4> magic{};
  if (!in.read(reinterpret_cast<char*>(magic.data()), 4)) {
    throw DataError(str("'", path, "' is too short for an IDX header (", file_size, " bytes)"));
  }
  if (magic[0] != 0 || magic[1] != 0) {
    throw DataError(str("'", path, "' is not an IDX file (bad magic number)"));
  }
  if (magic[2] != kUnsignedByte) {
    throw DataError(str("'", path, "' holds IDX type 0x", std::hex, int{magic[2]},
                        "; only unsigned bytes (0x08) are supported"));
  }
  if (magic[3] != ndim) {
    throw DataError(str("'", path, "' has ", int{magic[3]}, " dimensions; expected ", ndim));
  }
  std::vector<uint8_t> dims_raw(4 * static_cast<size_t>(ndim));
  if (!in.read(reinterpret_cast<char*>(dims_raw.data()), static_cast<std::streamsize>(dims_raw.size()))) {
    throw DataError(str("'", path, "' is too short for its IDX header"));
  }
  std::vector<int64_t> dims(static_cast<size_t>(ndim));
  uint64_t elements = 1;
  const uint64_t header = 4 + dims_raw.size();
  const uint64_t payload = file_size - header;
  for (int i = 0; i < ndim; ++i) {
    dims[i] = big_endian_u32(&dims_raw[4 * static_cast<size_t>(i)]);
    // Checked before multiplying further: elements never exceeds the payload, so no overflow.
    if (dims[i] != 0 && elements > payload / static_cast<uint64_t>(dims[i])) {
      throw DataError(str("'", path, "': its header declares more elements than the file's ",
                          payload, " bytes of data (truncated file?)"));
    }
    elements *= static_cast<uint64_t>(dims[i]);
  }
  if (elements != payload) {
    throw DataError(str("'", path, "': its header declares ", elements, " elements but the file has ",
                        payload, " bytes of data (", elements > payload ? "truncated" : "trailing bytes",
                        ")"));
  }
  at::Tensor data = at::empty(dims, at::kByte);
  if (elements > 0 &&
      !in.read(reinterpret_cast<char*>(data.data_ptr<uint8_t>()), static_cast<std::streamsize>(elements))) {
    throw DataError(str("'", path, "': read failed after the header"));
  }
  return data;
}

LabeledImages read_mnist_split(const std::string& dir, const std::string& prefix) {
  const std::string images_path = dir + "/" + prefix + "-images-idx3-ubyte";
  const std::string labels_path = dir + "/" + prefix + "-labels-idx1-ubyte";
  at::Tensor images = read_idx_ubyte(images_path, 3);
  at::Tensor labels = read_idx_ubyte(labels_path, 1);
  if (images.size(1) != kImageSize || images.size(2) != kImageSize) {
    throw DataError(str("'", images_path, "' holds ", images.size(1), "x", images.size(2),
                        " images; expected ", kImageSize, "x", kImageSize));
  }
  if (images.size(0) != labels.size(0)) {
    throw DataError(str("'", images_path, "' holds ", images.size(0), " images but '", labels_path,
                        "' ", labels.size(0), " labels"));
  }
  if (labels.numel() > 0) {
    const int max_label = labels.max().item<uint8_t>();
    if (max_label >= kNumClasses) {
      throw DataError(str("'", labels_path, "' holds label ", max_label, "; labels must be in [0, ",
                          kNumClasses, ")"));
    }
  }
  LabeledImages out;
  out.images = images.unsqueeze(1).to(at::kFloat).div_(255.0).sub_(kMnistMean).div_(kMnistStd);
  out.labels = labels.to(at::kLong);
  return out;
}

}  // namespace tdist::train
