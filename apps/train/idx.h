#pragma once
// IDX files, the format of the MNIST distribution (train-images-idx3-ubyte, ...): a big-endian
// header (two zero bytes, a type byte, the number of dimensions, then each dimension as a
// 32-bit count) followed by the elements. Only unsigned-byte files (type 0x08) are read.
//
// libtorch's torch::data::datasets::MNIST reads the same files, but insists on exactly 60000
// training and 10000 test images and stops with an assertion on a short file; this reader takes
// any count, so subsets and tiny generated files work, and checks the header against the file
// size before allocating (see DESIGN.md, Reliability rules).
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

// Images and labels of one MNIST split.
struct LabeledImages {
  at::Tensor images;  // float32 [N, 1, 28, 28], normalized with MNIST's mean and deviation
  at::Tensor labels;  // int64 [N], each in [0, 10)
};

// Reads <dir>/<prefix>-images-idx3-ubyte and <dir>/<prefix>-labels-idx1-ubyte (prefix "train"
// or "t10k"); checks that the images are 28x28, the counts agree and the labels are digits.
LabeledImages read_mnist_split(const std::string& dir, const std::string& prefix);

}  // namespace tdist::train
