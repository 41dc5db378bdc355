#pragma once
// The models tdist-train trains: classifiers of 1x28x28 images into 10 classes, and a byte-level
// language model.
//
//   mlp:  Flatten, then `layers` hidden Linear+ReLU layers of width `hidden`, then Linear to 10
//         (hidden 1024, layers 3: 784-1024-1024-1024-10).
//   conv: Conv 3x3 1->16, ReLU, MaxPool 2 (14x14); Conv 3x3 16->32, ReLU, MaxPool 2 (7x7);
//         Flatten; Linear 1568->hidden, ReLU; Linear hidden->10.
//   gpt:  a decoder-only transformer over bytes (GPT-2's layout, pre-norm): token embedding
//         256 x width plus a learned position embedding context x width; `layers` blocks of
//         [LayerNorm, causal self-attention with `heads` heads (one Linear width->3 width for
//         q, k, v; one width->width out), residual; LayerNorm, Linear width->4 width, GELU,
//         Linear 4 width->width, residual]; a final LayerNorm and a Linear width->256 (no
//         bias) giving the next byte's logits at every position. Each block is a submodule
//         called through tdist::fsdp::call: the units --strategy fsdp shards (and a plain call
//         otherwise). 4 blocks of width 256, context 128: 3,323,392 parameters.
//
// Plain functions; the returned module is owned by the caller (a shared holder).

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/options/loss.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tdist::train {

struct ModelConfig {
  std::string kind = "mlp";  // "mlp", "conv" or "gpt"
  int64_t hidden = 256;      // hidden width (mlp layers; conv's fully connected layer)
  int64_t layers = 2;        // mlp: number of hidden layers (0: a linear classifier); gpt: blocks
  int64_t width = 256;       // gpt: embedding width (a multiple of heads)
  int64_t heads = 4;         // gpt: attention heads
  int64_t context = 128;     // gpt: the longest sequence (bytes) it reads
};

inline constexpr int64_t kImageSize = 28;
inline constexpr int64_t kNumClasses = 10;
inline constexpr int64_t kVocabSize = 256;  // gpt: one token per byte

// A model as tdist-train drives it: forward(inputs) gives logits ([B, 10] for an image
// classifier, [B, T, 256] for gpt), and units() the submodules --strategy fsdp shards as units
// (none: the whole model is one group, the root's).
struct TrainModelImpl : torch::nn::Module {
  virtual at::Tensor forward(at::Tensor inputs) = 0;
  virtual std::vector<std::shared_ptr<torch::nn::Module>> units() { return {}; }
  // The model as a Sequential of its layers, sharing this model's parameter tensors (nothing is
  // copied), whose forward equals forward(): what --pp-stages cuts into pipeline stages. A
  // classifier's own layers; gpt: [embedding (tokens + positions), block 0, ..., block L-1,
  // head (final LayerNorm and Linear)].
  virtual torch::nn::Sequential layers() = 0;
};
using TrainModel = std::shared_ptr<TrainModelImpl>;

// Builds the model with freshly initialized parameters drawn from libtorch's default generator
// (seed it first for reproducible runs). InvalidArgument for an unknown kind or bad sizes.
// A classifier's parameters are named as build_model's Sequential names them ("0.weight", ...).
TrainModel build_train_model(const ModelConfig& config);

// The image classifiers alone (mlp or conv), as a Sequential (the RPC demos train it too).
torch::nn::Sequential build_model(const ModelConfig& config);

// Whether the model reads bytes (gpt) rather than images.
inline bool is_language_model(const ModelConfig& config) { return config.kind == "gpt"; }

// "mlp 784-1024-1024-1024-10", "conv 1x28x28 c16-c32 fc128-10", "gpt 4x256 h4 ctx128 bytes".
std::string describe_model(const ModelConfig& config);

// The loss of a batch's logits against its labels: cross-entropy per image, or per predicted
// byte of each window (logits [B, T, 256], labels [B, T]).
at::Tensor loss_of(
    const at::Tensor& logits, const at::Tensor& labels,
    torch::nn::functional::CrossEntropyFuncOptions::reduction_t reduction = torch::kMean);

// Number of scalar parameters.
int64_t count_parameters(const torch::nn::Module& module);

}  // namespace tdist::train
