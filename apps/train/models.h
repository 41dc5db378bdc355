#pragma once
// The models tdist-train trains: classifiers of 1x28x28 images into 10 classes.
//
//   mlp:  Flatten, then `layers` hidden Linear+ReLU layers of width `hidden`, then Linear to 10
//         (hidden 1024, layers 3: 784-1024-1024-1024-10).
//   conv: Conv 3x3 1->16, ReLU, MaxPool 2 (14x14); Conv 3x3 16->32, ReLU, MaxPool 2 (7x7);
//         Flatten; Linear 1568->hidden, ReLU; Linear hidden->10.
//
// Plain functions; the returned module is owned by the caller (a shared holder).

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <string>

namespace tdist::train {

struct ModelConfig {
  std::string kind = "mlp";  // "mlp" or "conv"
  int64_t hidden = 256;      // hidden width (mlp layers; conv's fully connected layer)
  int64_t layers = 2;        // mlp: number of hidden layers (0: a linear classifier)
};

inline constexpr int64_t kImageSize = 28;
inline constexpr int64_t kNumClasses = 10;

// Builds the model with freshly initialized parameters drawn from libtorch's default generator
// (seed it first for reproducible runs). InvalidArgument for an unknown kind or bad sizes.
torch::nn::Sequential build_model(const ModelConfig& config);

// "mlp 784-1024-1024-1024-10", "conv 1x28x28 c16-c32 fc128-10".
std::string describe_model(const ModelConfig& config);

// Number of scalar parameters.
int64_t count_parameters(const torch::nn::Module& module);

}  // namespace tdist::train
