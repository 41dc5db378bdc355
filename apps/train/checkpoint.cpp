#include "apps/train/checkpoint.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"

namespace tdist::train {
namespace {

constexpr int64_t kFormatVersion = 1;
constexpr int64_t kNoCheckpoint = -1;
constexpr int64_t kReadFailed = -2;

void write_all(int fd, const char* data, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) TDIST_THROW(Error, "cannot write checkpoint '", path, "': ", std::strerror(errno));
    data += w;
    n -= static_cast<size_t>(w);
  }
}

void fsync_or_throw(int fd, const std::string& path) {
  if (::fsync(fd) != 0) TDIST_THROW(Error, "cannot fsync '", path, "': ", std::strerror(errno));
}

int64_t read_int(torch::serialize::InputArchive& ar, const char* key) {
  c10::IValue v;
  ar.read(key, v);
  TDIST_CHECK(v.isInt(), "checkpoint entry '", key, "' is not an integer");
  return v.toInt();
}

double read_double(torch::serialize::InputArchive& ar, const char* key) {
  c10::IValue v;
  ar.read(key, v);
  TDIST_CHECK(v.isDouble(), "checkpoint entry '", key, "' is not a number");
  return v.toDouble();
}

}  // namespace

std::string checkpoint_path(const std::string& dir) { return dir + "/" + kCheckpointFile; }

void save_checkpoint(const std::string& dir, const torch::nn::Module& model,
                     const torch::optim::Optimizer& optimizer, const TrainState& state,
                     const std::string& fingerprint) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) TDIST_THROW(Error, "cannot create checkpoint directory '", dir, "': ", ec.message());

  torch::serialize::OutputArchive archive;
  archive.write("format_version", c10::IValue(kFormatVersion));
  archive.write("fingerprint", c10::IValue(fingerprint));
  archive.write("step", c10::IValue(state.step));
  archive.write("epoch", c10::IValue(state.epoch));
  archive.write("batch_in_epoch", c10::IValue(state.batch_in_epoch));
  archive.write("last_loss", c10::IValue(state.last_loss));
  archive.write("last_train_accuracy", c10::IValue(state.last_train_accuracy));
  if (state.rng_state.defined()) archive.write("rng_state", state.rng_state);
  torch::serialize::OutputArchive model_archive;
  model.save(model_archive);
  archive.write("model", model_archive);
  torch::serialize::OutputArchive optimizer_archive;
  optimizer.save(optimizer_archive);
  archive.write("optimizer", optimizer_archive);
  std::ostringstream bytes;
  archive.save_to(bytes);
  const std::string data = bytes.str();

  // Note [Checkpoint protocol] 2: temporary file, fsync, rename, fsync the directory.
  const std::string final_path = checkpoint_path(dir);
  // Temporary files of writes that were interrupted (the process was killed) are garbage.
  const std::string tmp_prefix = std::string(kCheckpointFile) + ".tmp.";
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.path().filename().string().rfind(tmp_prefix, 0) == 0) {
      std::filesystem::remove(entry.path(), ec);
    }
  }
  const std::string tmp_path = final_path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) TDIST_THROW(Error, "cannot create '", tmp_path, "': ", std::strerror(errno));
  try {
    write_all(fd, data.data(), data.size(), tmp_path);
    fsync_or_throw(fd, tmp_path);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp_path.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp_path.c_str(), final_path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp_path.c_str());
    TDIST_THROW(Error, "cannot rename '", tmp_path, "' to '", final_path, "': ", std::strerror(err));
  }
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // best effort: the rename is durable once the directory is
    ::close(dfd);
  }
}

std::optional<std::vector<char>> read_checkpoint_file(const std::string& dir) {
  const std::string path = checkpoint_path(dir);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return std::nullopt;
    TDIST_THROW(Error, "cannot read checkpoint '", path, "': ", std::strerror(errno));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) TDIST_THROW(Error, "cannot open checkpoint '", path, "'");
  std::vector<char> bytes(static_cast<size_t>(st.st_size));
  if (!bytes.empty() && !in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()))) {
    TDIST_THROW(Error, "cannot read checkpoint '", path, "'");
  }
  return bytes;
}

std::optional<std::vector<char>> share_checkpoint(comm::ProcessGroup& pg,
                                                  const std::optional<std::vector<char>>& bytes,
                                                  const std::string& read_error,
                                                  std::chrono::milliseconds timeout) {
  comm::BroadcastOptions opts;
  opts.root = 0;
  opts.timeout = timeout;
  at::Tensor size = at::zeros({1}, at::kLong);
  if (pg.rank() == 0) {
    size[0] = !read_error.empty() ? kReadFailed
              : bytes            ? static_cast<int64_t>(bytes->size())
                                 : kNoCheckpoint;
  }
  pg.broadcast(size, opts)->wait();
  const int64_t n = size[0].item<int64_t>();
  if (n == kReadFailed) {
    if (pg.rank() == 0) TDIST_THROW(Error, read_error);
    TDIST_THROW(Error, "rank 0 could not read the checkpoint to resume from (see its log)");
  }
  if (n == kNoCheckpoint) return std::nullopt;
  TDIST_CHECK(n >= 0, "bad checkpoint size ", n, " from rank 0");
  at::Tensor data = at::empty({n}, at::kByte);
  if (pg.rank() == 0 && n > 0) std::memcpy(data.data_ptr(), bytes->data(), static_cast<size_t>(n));
  if (pg.size() > 1 && n > 0) pg.broadcast(data, opts)->wait();
  const auto* p = reinterpret_cast<const char*>(data.data_ptr<uint8_t>());
  return std::vector<char>(p, p + n);
}

TrainState load_checkpoint(const std::vector<char>& bytes, torch::nn::Module& model,
                           torch::optim::Optimizer& optimizer, const std::string& fingerprint) {
  torch::serialize::InputArchive archive;
  TrainState state;
  try {
    archive.load_from(bytes.data(), bytes.size());
    const int64_t version = read_int(archive, "format_version");
    TDIST_CHECK(version == kFormatVersion, "checkpoint format version ", version,
                " is not the supported ", kFormatVersion);
  } catch (const c10::Error& e) {
    TDIST_THROW(Error, "the checkpoint is not readable: ", e.what_without_backtrace());
  }
  c10::IValue saved;
  archive.read("fingerprint", saved);
  if (!saved.isString() || saved.toStringRef() != fingerprint) {
    throw InvalidArgument(str("the checkpoint belongs to a different run; resume needs the same ",
                              "settings.\n  checkpoint: ",
                              saved.isString() ? saved.toStringRef() : std::string("?"),
                              "\n  this run:   ", fingerprint));
  }
  try {
    state.step = read_int(archive, "step");
    state.epoch = read_int(archive, "epoch");
    state.batch_in_epoch = read_int(archive, "batch_in_epoch");
    state.last_loss = read_double(archive, "last_loss");
    state.last_train_accuracy = read_double(archive, "last_train_accuracy");
    at::Tensor rng;
    if (archive.try_read("rng_state", rng)) state.rng_state = rng;
    torch::serialize::InputArchive model_archive;
    archive.read("model", model_archive);
    model.load(model_archive);
    torch::serialize::InputArchive optimizer_archive;
    archive.read("optimizer", optimizer_archive);
    optimizer.load(optimizer_archive);
  } catch (const c10::Error& e) {
    TDIST_THROW(Error, "the checkpoint is not readable: ", e.what_without_backtrace());
  }
  return state;
}

}  // namespace tdist::train
