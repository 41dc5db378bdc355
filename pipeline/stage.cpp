#include "tdist/pipeline/stage.h"

#include <torch/torch.h>

#include <algorithm>
#include <limits>

#include "tdist/core/error.h"

namespace tdist::pipeline {

namespace {

std::string join(const std::vector<int64_t>& v) {
  std::string s = "{";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "}";
}

}  // namespace

PipelineStage::PipelineStage(torch::nn::Sequential model, std::vector<int64_t> bounds, int rank,
                             int num_ranks)
    : rank_(rank), num_ranks_(num_ranks), bounds_(std::move(bounds)) {
  TDIST_CHECK_ARG(num_ranks >= 1 && rank >= 0 && rank < num_ranks, "pipeline stage: rank ", rank,
                  " of ", num_ranks, " ranks");
  const auto layers = static_cast<int64_t>(model->size());
  TDIST_CHECK_ARG(bounds_.size() >= 2 && bounds_.front() == 0 && bounds_.back() == layers,
                  "pipeline stage bounds ", join(bounds_),
                  " must start at 0 and end at the model's ", layers, " layers");
  for (size_t i = 1; i < bounds_.size(); ++i) {
    TDIST_CHECK_ARG(bounds_[i] > bounds_[i - 1], "pipeline stage bounds ", join(bounds_),
                    " must increase: stage ", i - 1, " would be empty");
  }
  const int stages = num_stages();
  TDIST_CHECK_ARG(stages % num_ranks == 0, "pipeline: ", stages,
                  " stages cannot be spread evenly over ", num_ranks, " ranks");
  for (int s = rank; s < stages; s += num_ranks) {
    torch::nn::Sequential chunk;
    const auto first = bounds_[static_cast<size_t>(s)];
    const auto end = bounds_[static_cast<size_t>(s) + 1];
    for (int64_t l = first; l < end; ++l) {
      chunk->push_back(std::to_string(l), *(model->begin() + l));
    }
    chunks_.push_back(chunk);
  }
}

std::vector<int64_t> PipelineStage::bounds_from_split_points(
    const torch::nn::Sequential& model, const std::vector<int64_t>& split_points) {
  std::vector<int64_t> b{0};
  b.insert(b.end(), split_points.begin(), split_points.end());
  b.push_back(static_cast<int64_t>(model->size()));
  return b;
}

std::vector<int64_t> PipelineStage::balanced_bounds(torch::nn::Sequential model, int num_stages) {
  const auto n = static_cast<int64_t>(model->size());
  TDIST_CHECK_ARG(num_stages >= 1 && num_stages <= n, "cannot cut a model of ", n, " layers into ",
                  num_stages, " stages");
  std::vector<int64_t> prefix(static_cast<size_t>(n) + 1, 0);
  for (int64_t l = 0; l < n; ++l) {
    int64_t count = 0;
    for (const auto& p : model[static_cast<size_t>(l)]->parameters()) count += p.numel();
    prefix[static_cast<size_t>(l) + 1] = prefix[static_cast<size_t>(l)] + count;
  }
  // best[k][j]: the smallest largest part cutting layers [0, j) into k parts; the classic
  // linear-partition dynamic program (n and stages are small).
  const int64_t kInf = std::numeric_limits<int64_t>::max();
  const auto K = static_cast<size_t>(num_stages);
  const auto N = static_cast<size_t>(n);
  std::vector<std::vector<int64_t>> best(K + 1, std::vector<int64_t>(N + 1, kInf));
  std::vector<std::vector<size_t>> cut(K + 1, std::vector<size_t>(N + 1, 0));
  best[0][0] = 0;
  for (size_t k = 1; k <= K; ++k) {
    for (size_t j = k; j <= N; ++j) {
      for (size_t i = k - 1; i < j; ++i) {
        if (best[k - 1][i] == kInf) continue;
        const int64_t cost = std::max(best[k - 1][i], prefix[j] - prefix[i]);
        if (cost < best[k][j]) {
          best[k][j] = cost;
          cut[k][j] = i;
        }
      }
    }
  }
  std::vector<int64_t> bounds(K + 1, 0);
  bounds[K] = n;
  for (size_t k = K, j = N; k > 0; --k) {
    j = cut[k][j];
    bounds[k - 1] = static_cast<int64_t>(j);
  }
  return bounds;
}

std::vector<at::Tensor> PipelineStage::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& c : chunks_) {
    for (auto& p : c->parameters()) out.push_back(p);
  }
  return out;
}

std::string PipelineStage::describe_stage(int stage) const {
  const auto s = static_cast<size_t>(stage);
  return str("stage ", stage, " (rank ", stage % num_ranks_, ", layers [", bounds_.at(s), ", ",
             bounds_.at(s + 1), "))");
}

}  // namespace tdist::pipeline
