#pragma once
// PipelineStage: this rank's contiguous part(s) of a torch::nn::Sequential.
//
// The model's layers are cut at `bounds` (b_0 = 0 < b_1 < ... < b_S = model->size()): virtual
// stage s holds layers [b_s, b_{s+1}). With p ranks and S = v * p virtual stages, rank r holds
// stages r, r + p, ..., r + (v - 1) * p as its chunks 0..v-1 (v > 1 for the interleaved
// schedule; Megatron's layout). The chunks are new Sequentials over the model's own layer
// modules: their parameters are the model's tensors, nothing is copied.
//
// Construction is local (no communication); the activation shapes between neighbours are
// agreed by Pipeline::setup. Not thread safe; owned by one Pipeline.

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tdist::pipeline {

class PipelineStage {
 public:
  // Throws InvalidArgument when bounds do not cut `model` into non-empty parts starting at 0
  // and ending at model->size(), or when their count is not a multiple of num_ranks.
  PipelineStage(torch::nn::Sequential model, std::vector<int64_t> bounds, int rank, int num_ranks);

  // Bounds cutting `model` into `num_stages` contiguous parts of nearly equal parameter counts
  // (the largest part as small as possible; every part at least one layer). InvalidArgument
  // when the model has fewer layers than num_stages.
  static std::vector<int64_t> balanced_bounds(torch::nn::Sequential model, int num_stages);
  // Bounds from explicit cut points: split_points {3, 5} on 8 layers gives {0, 3, 5, 8}.
  static std::vector<int64_t> bounds_from_split_points(const torch::nn::Sequential& model,
                                                       const std::vector<int64_t>& split_points);

  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  int num_chunks() const { return static_cast<int>(chunks_.size()); }
  int num_stages() const { return static_cast<int>(bounds_.size()) - 1; }
  // The virtual stage of chunk c: c * num_ranks + rank.
  int stage_index(int chunk) const { return chunk * num_ranks_ + rank_; }
  torch::nn::Sequential chunk(int c) const { return chunks_.at(static_cast<size_t>(c)); }
  // Parameters of every chunk of this rank (give these to the optimizer).
  std::vector<at::Tensor> parameters() const;
  const std::vector<int64_t>& bounds() const { return bounds_; }
  // "stage 2 (rank 2, layers [4, 6))".
  std::string describe_stage(int stage) const;

 private:
  // Constant after construction:
  int rank_;
  int num_ranks_;
  std::vector<int64_t> bounds_;
  std::vector<torch::nn::Sequential> chunks_;
};

}  // namespace tdist::pipeline
