#pragma once
// Training data for tdist-train: 1x28x28 images with labels in [0, 10), from a seeded synthetic
// generator or from MNIST-format IDX files (MNIST, Fashion-MNIST); windows of bytes of text for
// the language model; and the DistributedSampler that gives each rank its shard.
//
// Datasets are immutable after construction and safe to read from several threads.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tdist::train {

// An image batch, or a text batch (TextDataset): `images` the model's inputs, `labels` its
// targets.
struct Batch {
  at::Tensor images;  // float32 [B, 1, 28, 28]; text: int64 [B, T] bytes
  at::Tensor labels;  // int64 [B]; text: int64 [B, T], each the byte after its input
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

// Windows of a byte stream for next-byte prediction: sample i is the `context` bytes at
// offset(i) as inputs and the `context` bytes one further as targets. Without a limit the
// windows tile the stream (offset(i) = i * context, (bytes - 1) / context samples); with a limit
// L smaller than that, L windows spread evenly over it (offset(i) = floor(i * W / L) * context).
class TextDataset : public Dataset {
 public:
  TextDataset(at::Tensor bytes, int64_t context, int64_t limit = 0);
  int64_t size() const override { return size_; }
  Batch get(const std::vector<int64_t>& indices) const override;
  int64_t bytes() const { return bytes_.numel(); }

 private:
  int64_t offset(int64_t i) const;
  const at::Tensor bytes_;  // uint8 [n]
  const int64_t context_;
  int64_t windows_ = 0;  // tiling windows of the stream
  int64_t size_ = 0;
};

// The text of --dataset text: every *.py file under `dir` (recursively, not following directory
// links), in the byte order of their paths relative to `dir`. File k of that order goes to the
// held-out split when k % 20 == 19 (one file in 20), or, with fewer than 20 files, the last one;
// the others are the training text. Each split is its files' bytes concatenated. DataError when
// `dir` is missing or holds fewer than 2 such files, or a split is shorter than context + 1 bytes.
struct TextCorpus {
  at::Tensor train;  // uint8
  at::Tensor held_out;
  int64_t train_files = 0;
  int64_t held_out_files = 0;
};
TextCorpus read_text_corpus(const std::string& dir, int64_t context);

// The default --data-dir of --dataset text: the Python standard library's sources, the newest
// /usr/lib/python3.N present (every Debian system has one); empty when there is none.
std::string default_text_dir();

// Held-out windows --dataset text evaluates on unless --test-samples says otherwise.
inline constexpr int64_t kDefaultTextTestSamples = 256;

// Where Debian's dataset-fashion-mnist package puts the four gzip IDX files.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

struct DataConfig {
  std::string dataset = "synthetic";  // "synthetic", "mnist", "fashion-mnist" or "text"
  std::string data_dir;               // mnist: holds the four IDX files (fashion-mnist: default
                                      // kFashionMnistDir; text: default default_text_dir())
  int64_t train_samples = 60000;      // synthetic: size; mnist, text: a limit (0: all)
  int64_t test_samples = 10000;       // likewise for the test split
  int64_t context = 128;              // text: bytes per sample (the model's context)
  uint64_t seed = 0;
  double signal = 0.12;  // synthetic: strength of the class pattern (noise is 1)
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
