#pragma once
// IDX files, the format of the MNIST distribution (train-images-idx3-ubyte, ...): a big-endian
// header (two zero bytes, a type byte, the number of dimensions, then each dimension as a
// 32-bit count) followed by the elements. Only unsigned-byte files (type 0x08) are read, plain or
// gzip-compressed (a name ending in .gz, as MNIST and Fashion-MNIST are distributed).
//
// libtorch's torch::data::datasets::MNIST reads the same files, but insists on exactly 60000
// training and 10000 test images and stops with an assertion on a short file; this reader takes
// any count, so subsets and tiny generated files work, and checks the header against the file
// size (for gzip: the trailer's uncompressed size and deflate's largest expansion) before
// allocating.
//
// Plain functions; they throw DataError (an InvalidArgument) naming the file and the problem.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "tdist/core/error.h"

namespace tdist::train {

// Bad or missing input data (a user error: tdist-train exits with 2).
class DataError : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

// Reads an unsigned-byte IDX file with `ndim` dimensions into a uint8 tensor of that shape.
at::Tensor read_idx_ubyte(const std::string& path, int ndim);

// Images and labels of one MNIST-format split.
struct LabeledImages {
  at::Tensor images;  // float32 [N, 1, 28, 28]: pixel / 255, minus mean, over stddev
  at::Tensor labels;  // int64 [N], each in [0, 10)
};

// MNIST's and Fashion-MNIST's training-set pixel mean and standard deviation (pixels in [0, 1]).
inline constexpr double kMnistMean = 0.1307, kMnistStd = 0.3081;
inline constexpr double kFashionMnistMean = 0.2860, kFashionMnistStd = 0.3530;

// Reads <dir>/<prefix>-images-idx3-ubyte and <dir>/<prefix>-labels-idx1-ubyte (prefix "train"
// or "t10k"; each may be gzip-compressed, with .gz appended); checks that the images are 28x28,
// the counts agree and the labels are in [0, 10).
LabeledImages read_mnist_split(const std::string& dir, const std::string& prefix, double mean,
                               double stddev);

}  // namespace tdist::train
