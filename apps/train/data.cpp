#include "apps/train/data.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "apps/train/idx.h"
#include "apps/train/models.h"
#include "tdist/core/error.h"

namespace tdist::train {
namespace {

constexpr int64_t kPrototypeSide = 7;
constexpr uint64_t kPrototypeStream = 0x70726f746f747970ULL;  // "prototyp"
constexpr uint64_t kSamplerStream = 0x73616d706c657221ULL;    // "sampler!"

at::Generator make_generator(uint64_t seed) {
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}

std::string require_directory(const std::string& dir) {
  struct stat st {};
  if (dir.empty()) throw DataError("--dataset mnist needs --data-dir DIR (the MNIST IDX files)");
  if (::stat(dir.c_str(), &st) != 0) {
    throw DataError(str("--data-dir '", dir, "': ", std::strerror(errno)));
  }
  if (!S_ISDIR(st.st_mode)) throw DataError(str("--data-dir '", dir, "' is not a directory"));
  return dir;
}

std::shared_ptr<const Dataset> limited(LabeledImages split, int64_t limit) {
  if (limit > 0 && limit < split.images.size(0)) {
    split.images = split.images.slice(0, 0, limit).clone();
    split.labels = split.labels.slice(0, 0, limit).clone();
  }
  return std::make_shared<TensorDataset>(split.images, split.labels);
}

}  // namespace

uint64_t mix_seed(uint64_t a, uint64_t b) {
  // Two splitmix64 finalizer rounds over a combined word.
  uint64_t z = a * 0x9E3779B97F4A7C15ULL + b + 0x632BE59BD9B4E019ULL;
  for (int i = 0; i < 2; ++i) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
  }
  return z;
}

SyntheticDataset::SyntheticDataset(int64_t size, uint64_t seed, uint64_t split, double signal,
                                   double noise)
    : size_(size), seed_(seed), split_(split), signal_(signal), noise_(noise) {
  TDIST_CHECK_ARG(size >= 0, "synthetic dataset size ", size, " is negative");
  auto gen = make_generator(mix_seed(seed, kPrototypeStream));
  at::Tensor coarse =
      at::randn({kNumClasses, 1, kPrototypeSide, kPrototypeSide}, gen, at::TensorOptions(at::kFloat));
  at::Tensor fine = at::upsample_bilinear2d(coarse, {kImageSize, kImageSize}, /*align_corners=*/false);
  at::Tensor mean = fine.mean({1, 2, 3}, /*keepdim=*/true);
  at::Tensor std = fine.std({1, 2, 3}, /*unbiased=*/false, /*keepdim=*/true);
  prototypes_ = ((fine - mean) / std).contiguous();
}

Batch SyntheticDataset::get(const std::vector<int64_t>& indices) const {
  const auto n = static_cast<int64_t>(indices.size());
  Batch b;
  b.images = at::empty({n, 1, kImageSize, kImageSize}, at::kFloat);
  b.labels = at::empty({n}, at::kLong);
  auto* labels = b.labels.data_ptr<int64_t>();
  const uint64_t stream = mix_seed(seed_, split_);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t i = indices[static_cast<size_t>(j)];
    TDIST_CHECK_ARG(i >= 0 && i < size_, "sample index ", i, " is out of range [0, ", size_, ")");
    const uint64_t sample_seed = mix_seed(stream, static_cast<uint64_t>(i));
    labels[j] = static_cast<int64_t>(sample_seed % static_cast<uint64_t>(kNumClasses));
    auto gen = make_generator(sample_seed);
    b.images[j].normal_(0.0, noise_, gen);
  }
  b.images.add_(prototypes_.index_select(0, b.labels), signal_);
  return b;
}

TensorDataset::TensorDataset(at::Tensor images, at::Tensor labels)
    : images_(std::move(images)), labels_(std::move(labels)) {
  TDIST_CHECK_EQ(images_.size(0), labels_.size(0), "images and labels differ in count");
}

int64_t TensorDataset::size() const { return images_.size(0); }

Batch TensorDataset::get(const std::vector<int64_t>& indices) const {
  at::Tensor idx = at::tensor(indices, at::kLong);
  return Batch{images_.index_select(0, idx), labels_.index_select(0, idx)};
}

DataSplits load_data(const DataConfig& config) {
  DataSplits out;
  if (config.dataset == "synthetic") {
    out.train = std::make_shared<SyntheticDataset>(config.train_samples, config.seed, 0, config.signal);
    out.test = std::make_shared<SyntheticDataset>(config.test_samples, config.seed, 1, config.signal);
    out.description = str("synthetic (seed ", config.seed, ", signal ", config.signal, ", ",
                          config.train_samples, " train, ", config.test_samples, " test)");
    return out;
  }
  TDIST_CHECK_ARG(config.dataset == "mnist" || config.dataset == "fashion-mnist",
                  "unknown dataset '", config.dataset, "'");
  const bool fashion = config.dataset == "fashion-mnist";
  const std::string dir =
      require_directory(config.data_dir.empty() && fashion ? kFashionMnistDir : config.data_dir);
  const double mean = fashion ? kFashionMnistMean : kMnistMean;
  const double stddev = fashion ? kFashionMnistStd : kMnistStd;
  out.train = limited(read_mnist_split(dir, "train", mean, stddev), config.train_samples);
  out.test = limited(read_mnist_split(dir, "t10k", mean, stddev), config.test_samples);
  if (out.train->size() == 0) throw DataError(str("'", dir, "' holds no training images"));
  out.description = str(config.dataset, " ", dir, " (", out.train->size(), " train, ",
                        out.test->size(), " test)");
  return out;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, int world_size, int rank,
                                       bool shuffle, uint64_t seed)
    : dataset_size_(dataset_size),
      world_size_(world_size),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed) {
  TDIST_CHECK_ARG(world_size >= 1 && rank >= 0 && rank < world_size, "rank ", rank,
                  " of world size ", world_size);
  TDIST_CHECK_ARG(dataset_size >= 0, "dataset size ", dataset_size);
}

std::vector<int64_t> DistributedSampler::epoch_order(int64_t epoch) const {
  std::vector<int64_t> order(static_cast<size_t>(dataset_size_));
  if (shuffle_) {
    auto gen = make_generator(mix_seed(mix_seed(seed_, kSamplerStream), static_cast<uint64_t>(epoch)));
    at::Tensor perm = at::randperm(dataset_size_, gen, at::kLong);
    const auto* p = perm.data_ptr<int64_t>();
    order.assign(p, p + dataset_size_);
  } else {
    for (int64_t i = 0; i < dataset_size_; ++i) order[static_cast<size_t>(i)] = i;
  }
  return order;
}

std::vector<int64_t> DistributedSampler::step_indices(const std::vector<int64_t>& order,
                                                      int64_t position, int64_t batch) const {
  TDIST_CHECK_ARG(batch >= 1 && position >= 0 && steps_left(position, batch) >= 1,
                  "no step of ", batch, " samples per rank fits at position ", position,
                  " of an epoch of ", dataset_size_, " samples at world size ", world_size_);
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(batch));
  for (int64_t j = 0; j < batch; ++j) {
    mine.push_back(order[static_cast<size_t>(position + j * world_size_ + rank_)]);
  }
  return mine;
}

int64_t DistributedSampler::steps_left(int64_t position, int64_t batch) const {
  const int64_t per_step = batch * world_size_;
  return position >= dataset_size_ ? 0 : (dataset_size_ - position) / per_step;
}

}  // namespace tdist::train
