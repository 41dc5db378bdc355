#include "apps/train/data.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>

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

std::string read_whole_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(str("cannot read '", path.string(), "': ", std::strerror(errno)));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw DataError(str("cannot read '", path.string(), "'"));
  return bytes;
}

at::Tensor to_byte_tensor(const std::string& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(t.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  return t;
}

}  // namespace

TextDataset::TextDataset(at::Tensor bytes, int64_t context, int64_t limit)
    : bytes_(std::move(bytes)), context_(context) {
  TDIST_CHECK_ARG(bytes_.dim() == 1 && bytes_.scalar_type() == at::kByte,
                  "text: the stream must be one-dimensional uint8");
  TDIST_CHECK_ARG(context_ >= 1, "text: context ", context_, " < 1");
  windows_ = bytes_.numel() > 0 ? (bytes_.numel() - 1) / context_ : 0;
  size_ = limit > 0 ? std::min(limit, windows_) : windows_;
}

int64_t TextDataset::offset(int64_t i) const {
  const int64_t w = size_ == windows_ ? i : (i * windows_) / size_;
  return w * context_;
}

Batch TextDataset::get(const std::vector<int64_t>& indices) const {
  const auto n = static_cast<int64_t>(indices.size());
  at::Tensor windows = at::empty({n, context_ + 1}, at::kLong);
  auto out = windows.accessor<int64_t, 2>();
  const uint8_t* src = bytes_.data_ptr<uint8_t>();
  for (int64_t j = 0; j < n; ++j) {
    const int64_t i = indices[static_cast<size_t>(j)];
    TDIST_CHECK_ARG(i >= 0 && i < size_, "sample index ", i, " is out of range [0, ", size_, ")");
    const uint8_t* w = src + offset(i);
    for (int64_t k = 0; k <= context_; ++k) out[j][k] = w[k];
  }
  return Batch{windows.narrow(1, 0, context_).contiguous(),
               windows.narrow(1, 1, context_).contiguous()};
}

std::string default_text_dir() {
  const std::regex name(R"(python3\.(\d+))");
  std::string best;
  int best_minor = -1;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/usr/lib", ec)) {
    std::smatch m;
    const std::string file = e.path().filename().string();
    if (!std::regex_match(file, m, name) || !e.is_directory(ec)) continue;
    const int minor = std::stoi(m[1].str());
    if (minor > best_minor) {
      best_minor = minor;
      best = e.path().string();
    }
  }
  return best;
}

TextCorpus read_text_corpus(const std::string& dir, int64_t context) {
  namespace fs = std::filesystem;
  std::vector<std::string> files;  // relative to dir
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, ec), end;
  if (ec) throw DataError(str("--data-dir '", dir, "': ", ec.message()));
  for (; it != end; it.increment(ec)) {
    if (ec) throw DataError(str("--data-dir '", dir, "': ", ec.message()));
    if (it->path().extension() == ".py" && it->is_regular_file(ec)) {
      files.push_back(fs::relative(it->path(), dir).string());
    }
  }
  std::sort(files.begin(), files.end());
  if (files.size() < 2) {
    throw DataError(str("--data-dir '", dir, "' holds ", files.size(),
                        " .py file(s); --dataset text needs at least 2 (one is held out)"));
  }
  std::string train, held_out;
  TextCorpus c;
  for (size_t k = 0; k < files.size(); ++k) {
    const bool held = files.size() < 20 ? k + 1 == files.size() : k % 20 == 19;
    (held ? held_out : train) += read_whole_file(fs::path(dir) / files[k]);
    (held ? c.held_out_files : c.train_files) += 1;
  }
  auto check_length = [&](const char* split, const std::string& bytes) {
    if (static_cast<int64_t>(bytes.size()) < context + 1) {
      throw DataError(str("--data-dir '", dir, "': the ", split, " text has ", bytes.size(),
                          " bytes, fewer than one sample of --context ", context, " needs (",
                          context + 1, ")"));
    }
  };
  check_length("training", train);
  check_length("held-out", held_out);
  c.train = to_byte_tensor(train);
  c.held_out = to_byte_tensor(held_out);
  return c;
}

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
  at::Tensor coarse = at::randn({kNumClasses, 1, kPrototypeSide, kPrototypeSide}, gen,
                                at::TensorOptions(at::kFloat));
  at::Tensor fine =
      at::upsample_bilinear2d(coarse, {kImageSize, kImageSize}, /*align_corners=*/false);
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
    out.train =
        std::make_shared<SyntheticDataset>(config.train_samples, config.seed, 0, config.signal);
    out.test =
        std::make_shared<SyntheticDataset>(config.test_samples, config.seed, 1, config.signal);
    out.description = str("synthetic (seed ", config.seed, ", signal ", config.signal, ", ",
                          config.train_samples, " train, ", config.test_samples, " test)");
    return out;
  }
  if (config.dataset == "text") {
    std::string dir = config.data_dir.empty() ? default_text_dir() : config.data_dir;
    if (dir.empty()) {
      throw DataError(
          "--dataset text: no Python standard library under /usr/lib/python3.N; "
          "give --data-dir DIR (a directory of .py files)");
    }
    require_directory(dir);
    TextCorpus corpus = read_text_corpus(dir, config.context);
    auto train = std::make_shared<TextDataset>(corpus.train, config.context, config.train_samples);
    auto test = std::make_shared<TextDataset>(corpus.held_out, config.context, config.test_samples);
    out.description =
        str("text ", dir, " (", corpus.train_files, " files, ", train->bytes(),
            " bytes: ", train->size(), " train windows of ", config.context, "; ",
            corpus.held_out_files, " files held out, ", test->size(), " test windows)");
    out.train = std::move(train);
    out.test = std::move(test);
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

DistributedSampler::DistributedSampler(int64_t dataset_size, int world_size, int rank, bool shuffle,
                                       uint64_t seed)
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
    auto gen =
        make_generator(mix_seed(mix_seed(seed_, kSamplerStream), static_cast<uint64_t>(epoch)));
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
  TDIST_CHECK_ARG(batch >= 1 && position >= 0 && steps_left(position, batch) >= 1, "no step of ",
                  batch, " samples per rank fits at position ", position, " of an epoch of ",
                  dataset_size_, " samples at world size ", world_size_);
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
