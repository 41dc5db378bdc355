#pragma once
// Training data for tdist-train: 1x28x28 images with labels in [0, 10), from a seeded synthetic
// generator or from MNIST-format IDX files (MNIST, Fashion-MNIST), and the DistributedSampler that gives each rank its shard.
//
// Datasets are immutable after construction and safe to read from several threads.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tdist::train {

struct Batch {
  at::Tensor images;  // float32 [B, 1, 28, 28]
  at::Tensor labels;  // int64 [B]
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  // The samples at `indices` (each in [0, size())), stacked in that order.
  virtual Batch get(const std::vector<int64_t>& indices) const = 0;
};

// A learnable synthetic task shaped like MNIST. Each class c has a smooth prototype image P_c
// (random 7x7 values upsampled to 28x28, unit variance; drawn from `seed`); sample i has label
// y_i and image  signal * P_{y_i} + noise * N(0, 1),  where y_i and the noise are drawn from a
// generator seeded by (seed, split, i). A sample therefore depends only on (seed, split, i):
// nothing is stored, any index is produced on demand, and every rank and every run agrees.
// Prototypes of two classes lie about signal * sqrt(2 * 784) apart against unit noise: the
// smaller `signal`, the harder the task (chance is 10%).
class SyntheticDataset : public Dataset {
 public:
  // `split` separates streams (0: train, 1: test) that share the prototypes.
  SyntheticDataset(int64_t size, uint64_t seed, uint64_t split, double signal, double noise = 1.0);
  int64_t size() const override { return size_; }
  Batch get(const std::vector<int64_t>& indices) const override;

 private:
  // Constant after construction:
  const int64_t size_;
  const uint64_t seed_;
  const uint64_t split_;
  const double signal_;
  const double noise_;
  at::Tensor prototypes_;  // [10, 1, 28, 28]
};

// Samples held in memory (MNIST).
class TensorDataset : public Dataset {
 public:
  TensorDataset(at::Tensor images, at::Tensor labels);
  int64_t size() const override;
  Batch get(const std::vector<int64_t>& indices) const override;

 private:
  const at::Tensor images_;
  const at::Tensor labels_;
};

// Where Debian's dataset-fashion-mnist package puts the four gzip IDX files.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

struct DataConfig {
  std::string dataset = "synthetic";  // "synthetic", "mnist" or "fashion-mnist"
  std::string data_dir;               // mnist: holds the four IDX files (fashion-mnist: default
                                      // kFashionMnistDir)
  int64_t train_samples = 60000;      // synthetic: size; mnist: a limit (0: all)
  int64_t test_samples = 10000;       // likewise for the test split
  uint64_t seed = 0;
  double signal = 0.12;               // synthetic: strength of the class pattern (noise is 1)
};

struct DataSplits {
  std::shared_ptr<const Dataset> train;
  std::shared_ptr<const Dataset> test;
  std::string description;  // "synthetic (60000 train, 10000 test)", "mnist DIR (...)"
};

// Builds the splits. DataError (exit 2 in tdist-train) for a missing directory or bad files.
DataSplits load_data(const DataConfig& config);

// PyTorch's DistributedSampler, with the position counted in samples (Note [Elastic resume] in
// trainer.cpp): each epoch a permutation of [0, dataset_size) seeded by (seed, epoch) (or the
// identity without shuffle), the same on every rank and for every world size. A step that starts
// at `position` of the epoch gives rank r the samples at position + j * world_size + r,
// j < batch: a step consumes batch x world_size consecutive samples of the permutation, and the
// epoch ends when fewer than that remain (the incomplete last step is dropped). For a fixed world
// size this is PyTorch's assignment (rank r takes positions r, r + world_size, ...). Pure; thread
// safe.
class DistributedSampler {
 public:
  DistributedSampler(int64_t dataset_size, int world_size, int rank, bool shuffle, uint64_t seed);
  // The permutation of epoch `epoch`.
  std::vector<int64_t> epoch_order(int64_t epoch) const;
  // This rank's `batch` samples of the step that starts at `position` of `order`.
  std::vector<int64_t> step_indices(const std::vector<int64_t>& order, int64_t position,
                                    int64_t batch) const;
  // Steps of `batch` samples per rank that fit between `position` and the end of an epoch.
  int64_t steps_left(int64_t position, int64_t batch) const;

 private:
  const int64_t dataset_size_;
  const int world_size_;
  const int rank_;
  const bool shuffle_;
  const uint64_t seed_;
};

// Mixes values into a 64-bit seed (splitmix64 steps); used for every derived seed.
uint64_t mix_seed(uint64_t a, uint64_t b);

}  // namespace tdist::train
