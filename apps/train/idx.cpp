#include "apps/train/idx.h"

#include <ATen/ATen.h>
#include <sys/stat.h>
#include <zlib.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <algorithm>
#include <fstream>
#include <memory>
#include <vector>

#include "apps/train/models.h"

namespace tdist::train {
namespace {

constexpr uint8_t kUnsignedByte = 0x08;

uint32_t big_endian_u32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

}  // namespace

namespace {

// The bytes of an IDX file, raw or gzip-compressed, read front to back.
class IdxSource {
 public:
  virtual ~IdxSource() = default;
  // Reads exactly n bytes; false at the end of the data.
  virtual bool read(uint8_t* out, uint64_t n) = 0;
  // Checks, before anything is allocated, that the data after a `header`-byte header holds
  // exactly `elements` bytes (as far as can be known before reading them); DataError otherwise.
  virtual void check_payload(uint64_t header, uint64_t elements) const = 0;
  // After the elements: nothing may follow.
  virtual void check_end() = 0;
};

class RawSource : public IdxSource {
 public:
  RawSource(std::string path, uint64_t file_size)
      : path_(std::move(path)), file_size_(file_size), in_(path_, std::ios::binary) {
    if (!in_) throw DataError(str("cannot open '", path_, "'"));
  }
  bool read(uint8_t* out, uint64_t n) override {
    return static_cast<bool>(
        in_.read(reinterpret_cast<char*>(out), static_cast<std::streamsize>(n)));
  }
  void check_payload(uint64_t header, uint64_t elements) const override {
    const uint64_t payload = file_size_ - header;
    if (elements != payload) {
      throw DataError(str("'", path_, "': its header declares ", elements,
                          " elements but the file has ", payload, " bytes of data (",
                          elements > payload ? "truncated" : "trailing bytes", ")"));
    }
  }
  void check_end() override {}

 private:
  const std::string path_;
  const uint64_t file_size_;
  std::ifstream in_;
};

// A gzip file (one member): the compressed bytes are held, the elements inflated straight into
// the tensor. The declared size is checked against the gzip trailer's ISIZE (the uncompressed
// size mod 2^32) and against deflate's largest expansion before anything is allocated.
class GzipSource : public IdxSource {
 public:
  GzipSource(std::string path, uint64_t file_size) : path_(std::move(path)) {
    std::ifstream in(path_, std::ios::binary);
    if (!in) throw DataError(str("cannot open '", path_, "'"));
    compressed_.resize(file_size);
    if (!in.read(reinterpret_cast<char*>(compressed_.data()),
                 static_cast<std::streamsize>(file_size))) {
      throw DataError(str("'", path_, "': read failed"));
    }
    if (file_size < 18) throw DataError(str("'", path_, "' is too short for a gzip file"));
    const uint8_t* t = compressed_.data() + file_size - 4;
    isize_ =
        uint32_t{t[0]} | (uint32_t{t[1]} << 8) | (uint32_t{t[2]} << 16) | (uint32_t{t[3]} << 24);
    if (inflateInit2(&zs_, 16 + MAX_WBITS) != Z_OK) throw DataError("zlib: inflateInit2 failed");
    zs_.next_in = compressed_.data();
    zs_.avail_in = static_cast<uInt>(std::min<uint64_t>(file_size, UINT32_MAX));
  }
  ~GzipSource() override { inflateEnd(&zs_); }

  bool read(uint8_t* out, uint64_t n) override {
    while (n > 0) {
      if (ended_) return false;
      const uInt chunk = static_cast<uInt>(std::min<uint64_t>(n, 1u << 30));
      zs_.next_out = out;
      zs_.avail_out = chunk;
      const int rc = inflate(&zs_, Z_NO_FLUSH);
      const uint64_t got = chunk - zs_.avail_out;
      out += got;
      n -= got;
      if (rc == Z_STREAM_END) {
        ended_ = true;
      } else if (rc != Z_OK && !(rc == Z_BUF_ERROR && got > 0)) {
        throw DataError(
            str("'", path_, "': corrupt gzip data (zlib: ", zs_.msg ? zs_.msg : "error", ")"));
      } else if (got == 0 && zs_.avail_in == 0) {
        return false;  // the compressed data ended without the end of the stream
      }
    }
    return true;
  }
  void check_payload(uint64_t header, uint64_t elements) const override {
    // Deflate expands at most about 1032:1; and ISIZE is the whole size mod 2^32.
    const uint64_t limit = static_cast<uint64_t>(compressed_.size()) * 1032;
    if (elements > limit || static_cast<uint32_t>(header + elements) != isize_) {
      throw DataError(str("'", path_, "': its header declares ", elements,
                          " elements but the gzip stream holds ", isize_,
                          " bytes (mod 2^32) in all", " (truncated or corrupt file?)"));
    }
  }
  void check_end() override {
    uint8_t extra = 0;
    if (read(&extra, 1) || !ended_ || zs_.avail_in != 0) {
      throw DataError(str("'", path_, "': bytes after the IDX data (only single-member gzip ",
                          "files of exactly one IDX file are read)"));
    }
  }

 private:
  const std::string path_;
  std::vector<uint8_t> compressed_;
  uint32_t isize_ = 0;
  z_stream zs_{};
  bool ended_ = false;
};

}  // namespace

at::Tensor read_idx_ubyte(const std::string& path, int ndim) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw DataError(str("cannot read '", path, "': ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) throw DataError(str("'", path, "' is not a regular file"));
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  const bool gzip = path.size() > 3 && path.compare(path.size() - 3, 3, ".gz") == 0;
  std::unique_ptr<IdxSource> in;
  if (gzip) {
    in = std::make_unique<GzipSource>(path, file_size);
  } else {
    in = std::make_unique<RawSource>(path, file_size);
  }

  std::array<uint8_t, 4> magic{};
  if (!in->read(magic.data(), 4)) {
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
  if (!in->read(dims_raw.data(), dims_raw.size())) {
    throw DataError(str("'", path, "' is too short for its IDX header"));
  }
  const uint64_t header = 4 + dims_raw.size();
  // No IDX file here is larger than 2^40 bytes; the bound keeps the product from overflowing.
  // It bounds the product of the non-zero dimensions: a zero does not make [0, 2^32-1, 2^32-1]
  // a shape libtorch can make (its strides overflow int64).
  constexpr uint64_t kMaxElements = uint64_t{1} << 40;
  std::vector<int64_t> dims(static_cast<size_t>(ndim));
  uint64_t nonzero = 1;
  bool empty = false;
  for (int i = 0; i < ndim; ++i) {
    dims[i] = big_endian_u32(&dims_raw[4 * static_cast<size_t>(i)]);
    if (dims[i] == 0) {
      empty = true;
      continue;
    }
    if (nonzero > kMaxElements / static_cast<uint64_t>(dims[i])) {
      throw DataError(
          str("'", path, "': its header declares dimensions whose product exceeds ", "2^40"));
    }
    nonzero *= static_cast<uint64_t>(dims[i]);
  }
  const uint64_t elements = empty ? 0 : nonzero;
  in->check_payload(header, elements);
  at::Tensor data = at::empty(dims, at::kByte);
  if (elements > 0 && !in->read(data.data_ptr<uint8_t>(), elements)) {
    throw DataError(
        str("'", path, "': the data ends before the ", elements, " elements its header declares"));
  }
  in->check_end();
  return data;
}

namespace {

// <dir>/<name>, or <dir>/<name>.gz when only that exists.
std::string idx_path(const std::string& dir, const std::string& name) {
  const std::string plain = dir + "/" + name;
  struct stat st {};
  if (::stat(plain.c_str(), &st) != 0 && ::stat((plain + ".gz").c_str(), &st) == 0) {
    return plain + ".gz";
  }
  return plain;
}

}  // namespace

LabeledImages read_mnist_split(const std::string& dir, const std::string& prefix, double mean,
                               double stddev) {
  const std::string images_path = idx_path(dir, prefix + "-images-idx3-ubyte");
  const std::string labels_path = idx_path(dir, prefix + "-labels-idx1-ubyte");
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
  out.images = images.unsqueeze(1).to(at::kFloat).div_(255.0).sub_(mean).div_(stddev);
  out.labels = labels.to(at::kLong);
  return out;
}

}  // namespace tdist::train
