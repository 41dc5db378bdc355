#pragma once
// Shared pieces of the pipeline tests: the model every rank builds alike, the single-process
// reference step, and the processes' store.

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "tdist/comm/process_group.h"
#include "tdist/core/env.h"
#include "tdist/core/tcp_store.h"
#include "tdist/pipeline/pipeline.h"

namespace tdist::test {

constexpr int64_t kWidth = 6;
constexpr int64_t kOut = 3;

// 4p layers (Linear and Tanh in turn, the last a Linear to kOut): enough for the interleaved
// schedule's 2p virtual stages. Equal on every rank for one seed.
inline torch::nn::Sequential make_model(int p, uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential model;
  const int layers = 4 * p;
  for (int l = 0; l < layers; ++l) {
    if (l == layers - 1) {
      model->push_back(torch::nn::Linear(kWidth, kOut));
    } else if (l % 2 == 0) {
      model->push_back(torch::nn::Linear(kWidth, kWidth));
    } else {
      model->push_back(torch::nn::Tanh());
    }
  }
  return model;
}

inline at::Tensor mse(const at::Tensor& out, const at::Tensor& y) {
  return torch::mse_loss(out, y);
}

// Virtual-stage bounds: `stages` parts of (nearly) equal layer counts.
inline std::vector<int64_t> even_bounds(int64_t layers, int stages) {
  std::vector<int64_t> b;
  for (int s = 0; s <= stages; ++s) b.push_back(layers * s / stages);
  return b;
}

// The parameters of the whole model that `stage` holds, in the stage's order.
inline std::vector<at::Tensor> stage_params_of(torch::nn::Sequential model,
                                               const pipeline::PipelineStage& stage) {
  std::vector<at::Tensor> out;
  const auto& b = stage.bounds();
  for (int c = 0; c < stage.num_chunks(); ++c) {
    const int s = stage.stage_index(c);
    for (int64_t l = b[static_cast<size_t>(s)]; l < b[static_cast<size_t>(s) + 1]; ++l) {
      for (auto& p : model[static_cast<size_t>(l)]->parameters()) out.push_back(p);
    }
  }
  return out;
}

inline std::shared_ptr<Store> child_store() {
  auto port = static_cast<uint16_t>(env::require_int("TDIST_TEST_STORE_PORT", 1, 65535));
  return std::make_shared<TCPStore>("127.0.0.1", port, false, Millis(60000));
}

inline comm::ProcessGroup::Options group_options(Millis timeout) {
  comm::ProcessGroup::Options o;
  o.timeout = timeout;
  return o;
}

}  // namespace tdist::test
