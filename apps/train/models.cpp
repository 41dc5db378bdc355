#include "apps/train/models.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/pooling.h>

#include <cmath>

#include "tdist/core/error.h"
#include "tdist/fsdp/fully_shard.h"

namespace tdist::train {
namespace {

constexpr int64_t kConv1Channels = 16;
constexpr int64_t kConv2Channels = 32;

void check_config(const ModelConfig& c) {
  TDIST_CHECK_ARG(c.kind == "mlp" || c.kind == "conv" || c.kind == "gpt", "unknown model '", c.kind,
                  "' (known: mlp, conv, gpt)");
  if (c.kind == "gpt") {
    TDIST_CHECK_ARG(c.layers >= 1 && c.layers <= 256, "--layers ", c.layers,
                    ": a gpt has 1 to 256 blocks");
    TDIST_CHECK_ARG(c.heads >= 1 && c.heads <= 1024, "--heads ", c.heads, " is not in [1, 1024]");
    TDIST_CHECK_ARG(c.width >= 1 && c.width <= (1 << 16) && c.width % c.heads == 0, "--width ",
                    c.width, " must be in [1, 65536] and a multiple of --heads ", c.heads);
    TDIST_CHECK_ARG(c.context >= 1 && c.context <= (1 << 20), "--context ", c.context,
                    " is not in [1, 1048576]");
    return;
  }
  TDIST_CHECK_ARG(c.hidden >= 1 && c.hidden <= (1 << 16), "hidden width ", c.hidden,
                  " is not in [1, 65536]");
  TDIST_CHECK_ARG(c.layers >= 0 && c.layers <= 64, "hidden layer count ", c.layers,
                  " is not in [0, 64]");
}

// An image classifier: the Sequential's layers registered under the Sequential's own names, so
// parameter names (and checkpoints) are those of the Sequential.
struct ClassifierImpl : TrainModelImpl {
  explicit ClassifierImpl(torch::nn::Sequential seq) : seq_(std::move(seq)) {
    for (const auto& item : seq_->named_children()) register_module(item.key(), item.value());
  }
  at::Tensor forward(at::Tensor inputs) override { return seq_->forward(inputs); }
  torch::nn::Sequential layers() override { return seq_; }
  torch::nn::Sequential seq_;
};

// One transformer block (see the file comment of models.h).
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t width, int64_t heads)
      : heads_(heads),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        qkv(register_module("qkv", torch::nn::Linear(width, 3 * width))),
        proj(register_module("proj", torch::nn::Linear(width, width))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        fc(register_module("fc", torch::nn::Linear(width, 4 * width))),
        out(register_module("out", torch::nn::Linear(4 * width, width))) {}

  at::Tensor forward(at::Tensor x) {
    const int64_t b = x.size(0), t = x.size(1), w = x.size(2), d = w / heads_;
    // [B, T, 3W] -> three [B, H, T, D]
    auto parts = qkv(ln1(x)).view({b, t, 3, heads_, d}).permute({2, 0, 3, 1, 4}).unbind(0);
    at::Tensor y = at::scaled_dot_product_attention(parts[0], parts[1], parts[2], {},
                                                    /*dropout_p=*/0.0, /*is_causal=*/true);
    x = x + proj(y.transpose(1, 2).reshape({b, t, w}));
    return x + out(at::gelu(fc(ln2(x))));
  }

  int64_t heads_;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc, out;
};
TORCH_MODULE(Block);

// The first and last layers of a gpt's layers(): modules over the gpt's own embedding, position
// table, final LayerNorm and head (registered again here, so the tensors are shared).
struct EmbedImpl : torch::nn::Module {
  EmbedImpl(torch::nn::Embedding t, at::Tensor p)
      : tokens(register_module("tokens", std::move(t))),
        positions(register_parameter("positions", std::move(p))) {}
  at::Tensor forward(at::Tensor inputs) {
    return tokens(inputs) + positions.narrow(0, 0, inputs.size(1));
  }
  torch::nn::Embedding tokens;
  at::Tensor positions;
};
TORCH_MODULE(Embed);

struct HeadImpl : torch::nn::Module {
  HeadImpl(torch::nn::LayerNorm l, torch::nn::Linear h)
      : ln_f(register_module("ln_f", std::move(l))), head(register_module("head", std::move(h))) {}
  at::Tensor forward(at::Tensor x) { return head(ln_f(x)); }
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear head;
};
TORCH_MODULE(Head);

struct GPTImpl : TrainModelImpl {
  // Registered in the order the forward uses them (DDP's buckets follow the reverse order).
  explicit GPTImpl(const ModelConfig& c) : context_(c.context) {
    tokens = register_module("tokens", torch::nn::Embedding(kVocabSize, c.width));
    positions = register_parameter("positions", at::empty({c.context, c.width}));
    // A ModuleList names them blocks.0, blocks.1, ...; `blocks` keeps their typed holders.
    auto list = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.layers; ++i) {
      blocks.push_back(Block(c.width, c.heads));
      list->push_back(blocks.back());
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
    head = register_module(
        "head", torch::nn::Linear(torch::nn::LinearOptions(c.width, kVocabSize).bias(false)));
    // GPT-2's initialisation of the embeddings (libtorch's N(0, 1) is far too large for them).
    at::NoGradGuard no_grad;
    tokens->weight.normal_(0.0, 0.02);
    positions.normal_(0.0, 0.02);
  }

  // inputs: int64 [B, T] bytes, T <= context; logits [B, T, 256].
  at::Tensor forward(at::Tensor inputs) override {
    TDIST_CHECK_ARG(inputs.dim() == 2 && inputs.size(1) <= context_, "gpt: inputs of shape ",
                    inputs.sizes(), " (want [batch, <= ", context_, "])");
    at::Tensor x = tokens(inputs) + positions.narrow(0, 0, inputs.size(1));
    for (auto& block : blocks) x = fsdp::call(block, x);
    return head(ln_f(x));
  }

  std::vector<std::shared_ptr<torch::nn::Module>> units() override {
    std::vector<std::shared_ptr<torch::nn::Module>> out;
    for (auto& block : blocks) out.push_back(block.ptr());
    return out;
  }

  torch::nn::Sequential layers() override {
    torch::nn::Sequential seq;
    seq->push_back(Embed(tokens, positions));
    for (auto& block : blocks) seq->push_back(block);
    seq->push_back(Head(ln_f, head));
    return seq;
  }

  int64_t context_;
  torch::nn::Embedding tokens{nullptr};
  at::Tensor positions;
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
};

}  // namespace

TrainModel build_train_model(const ModelConfig& config) {
  check_config(config);
  if (config.kind == "gpt") return std::make_shared<GPTImpl>(config);
  return std::make_shared<ClassifierImpl>(build_model(config));
}

torch::nn::Sequential build_model(const ModelConfig& config) {
  check_config(config);
  TDIST_CHECK_ARG(config.kind != "gpt",
                  "build_model builds the image classifiers (mlp, conv); "
                  "gpt is built by build_train_model");
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
  if (config.kind == "gpt") {
    return str("gpt ", config.layers, "x", config.width, " h", config.heads, " ctx", config.context,
               " bytes");
  }
  if (config.kind == "mlp") {
    std::string s = "mlp " + std::to_string(kImageSize * kImageSize);
    for (int64_t i = 0; i < config.layers; ++i) s += "-" + std::to_string(config.hidden);
    return s + "-" + std::to_string(kNumClasses);
  }
  return str("conv 1x", kImageSize, "x", kImageSize, " c", kConv1Channels, "-c", kConv2Channels,
             " fc", config.hidden, "-", kNumClasses);
}

at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& labels,
                   torch::nn::functional::CrossEntropyFuncOptions::reduction_t reduction) {
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}), labels.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(reduction));
}

int64_t count_parameters(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

}  // namespace tdist::train
