#include "apps/train/models.h"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>

#include "tdist/core/error.h"

namespace tdist::train {
namespace {

constexpr int64_t kConv1Channels = 16;
constexpr int64_t kConv2Channels = 32;

void check_config(const ModelConfig& c) {
  TDIST_CHECK_ARG(c.kind == "mlp" || c.kind == "conv", "unknown model '", c.kind,
                  "' (known: mlp, conv)");
  TDIST_CHECK_ARG(c.hidden >= 1 && c.hidden <= (1 << 16), "hidden width ", c.hidden,
                  " is not in [1, 65536]");
  TDIST_CHECK_ARG(c.layers >= 0 && c.layers <= 64, "hidden layer count ", c.layers,
                  " is not in [0, 64]");
}

}  // namespace

torch::nn::Sequential build_model(const ModelConfig& config) {
  check_config(config);
  namespace nn = torch::nn;
  nn::Sequential seq;
  if (config.kind == "mlp") {
    seq->push_back(nn::Flatten());
    int64_t width = kImageSize * kImageSize;
    for (int64_t i = 0; i < config.layers; ++i) {
      seq->push_back(nn::Linear(width, config.hidden));
      seq->push_back(nn::ReLU());
      width = config.hidden;
    }
    seq->push_back(nn::Linear(width, kNumClasses));
    return seq;
  }
  seq->push_back(nn::Conv2d(nn::Conv2dOptions(1, kConv1Channels, 3).padding(1)));
  seq->push_back(nn::ReLU());
  seq->push_back(nn::MaxPool2d(nn::MaxPool2dOptions(2)));
  seq->push_back(nn::Conv2d(nn::Conv2dOptions(kConv1Channels, kConv2Channels, 3).padding(1)));
  seq->push_back(nn::ReLU());
  seq->push_back(nn::MaxPool2d(nn::MaxPool2dOptions(2)));
  seq->push_back(nn::Flatten());
  seq->push_back(nn::Linear(kConv2Channels * (kImageSize / 4) * (kImageSize / 4), config.hidden));
  seq->push_back(nn::ReLU());
  seq->push_back(nn::Linear(config.hidden, kNumClasses));
  return seq;
}

std::string describe_model(const ModelConfig& config) {
  check_config(config);
  if (config.kind == "mlp") {
    std::string s = "mlp " + std::to_string(kImageSize * kImageSize);
    for (int64_t i = 0; i < config.layers; ++i) s += "-" + std::to_string(config.hidden);
    return s + "-" + std::to_string(kNumClasses);
  }
  return str("conv 1x", kImageSize, "x", kImageSize, " c", kConv1Channels, "-c", kConv2Channels,
             " fc", config.hidden, "-", kNumClasses);
}

int64_t count_parameters(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

}  // namespace tdist::train
