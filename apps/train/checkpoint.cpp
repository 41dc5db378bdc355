#include "apps/train/checkpoint.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"
#include "tdist/core/wire.h"

namespace tdist::train {
namespace {

constexpr int64_t kNoCheckpoint = -1;
constexpr int64_t kReadFailed = -2;
// Note [Checkpoint protocol] 4: the file starts with kMagic (which also names the format
// version), the fingerprint's length (u64, little endian), the fingerprint and the SHA-256 of
// libtorch's archive, which follows. The fingerprint and the digest are checked before libtorch
// parses anything: a damaged or truncated archive never reaches its reader (which leaks on some
// and throws what it likes on others).
constexpr char kMagic[8] = {'T', 'D', 'C', 'K', 'P', 'T', '0', '4'};
constexpr size_t kMaxFingerprint = 1 << 16;
// Rank 0 broadcasts a checkpoint in pieces of this size: the other ranks' memory grows with
// the bytes that arrived, never with a size rank 0 announced.
constexpr int64_t kShareChunk = int64_t(64) << 20;

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

using Sha256 = std::array<uint8_t, 32>;

Sha256 sha256(const void* data, size_t size) {
  Sha256 out{};
  unsigned int len = 0;
  TDIST_CHECK(EVP_Digest(data, size, out.data(), &len, EVP_sha256(), nullptr) == 1 &&
                  len == out.size(),
              "SHA-256 failed");
  return out;
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

  TDIST_CHECK_ARG(fingerprint.size() <= kMaxFingerprint, "checkpoint fingerprint of ",
                  fingerprint.size(), " bytes exceeds ", kMaxFingerprint);
  torch::serialize::OutputArchive archive;
  archive.write("step", c10::IValue(state.step));
  archive.write("epoch", c10::IValue(state.epoch));
  archive.write("epoch_position", c10::IValue(state.epoch_position));
  archive.write("world_size", c10::IValue(state.world_size));
  archive.write("last_loss", c10::IValue(state.last_loss));
  archive.write("last_train_accuracy", c10::IValue(state.last_train_accuracy));
  if (state.rng_state.defined()) archive.write("rng_state", state.rng_state);
  torch::serialize::OutputArchive model_archive;
  model.save(model_archive);
  archive.write("model", model_archive);
  torch::serialize::OutputArchive optimizer_archive;
  optimizer.save(optimizer_archive);
  archive.write("optimizer", optimizer_archive);
  std::ostringstream archive_bytes;
  archive.save_to(archive_bytes);
  const std::string body = archive_bytes.str();
  Bytes head;
  wire::Writer w(head);
  w.raw(kMagic, sizeof(kMagic));
  w.string(fingerprint);
  const Sha256 digest = sha256(body.data(), body.size());
  w.raw(digest.data(), digest.size());

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
  // A new file, never one planted at that name (a link would make us write through it).
  int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) TDIST_THROW(Error, "cannot create '", tmp_path, "': ", std::strerror(errno));
  try {
    write_all(fd, reinterpret_cast<const char*>(head.data()), head.size(), tmp_path);
    write_all(fd, body.data(), body.size(), tmp_path);
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
  const bool root = pg.rank() == 0;
  std::vector<char> out;
  for (int64_t done = 0; done < n;) {
    const int64_t piece = std::min(kShareChunk, n - done);
    at::Tensor chunk = at::empty({piece}, at::kByte);
    if (root) std::memcpy(chunk.data_ptr(), bytes->data() + done, static_cast<size_t>(piece));
    if (pg.size() > 1) pg.broadcast(chunk, opts)->wait();
    const auto* p = reinterpret_cast<const char*>(chunk.data_ptr<uint8_t>());
    if (!root) out.insert(out.end(), p, p + piece);
    done += piece;
  }
  return root ? bytes : std::optional<std::vector<char>>(std::move(out));
}

TrainState load_checkpoint(const std::vector<char>& bytes, torch::nn::Module& model,
                           torch::optim::Optimizer& optimizer, const std::string& fingerprint,
                           c10::Device device) {
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  wire::Reader r(data, bytes.size());
  std::string saved;
  try {
    if (std::memcmp(r.raw(sizeof(kMagic), "header"), kMagic, sizeof(kMagic)) != 0) {
      throw ProtocolError("it does not start with this version's header (not a tdist-train "
                          "checkpoint, or one from an older version)");
    }
    saved = r.string("fingerprint", kMaxFingerprint);
  } catch (const ProtocolError& e) {
    TDIST_THROW(Error, "the checkpoint is not readable: ", e.what());
  }
  if (saved != fingerprint) {
    throw InvalidArgument(str("the checkpoint belongs to a different run; resume needs the same ",
                              "settings.\n  checkpoint: ", saved, "\n  this run:   ", fingerprint));
  }
  if (r.remaining() < sizeof(Sha256)) {
    TDIST_THROW(Error, "the checkpoint is not readable: it ends inside its header");
  }
  const uint8_t* digest = r.raw(sizeof(Sha256), "archive digest");
  const size_t archive_at = bytes.size() - r.remaining();
  const Sha256 actual = sha256(bytes.data() + archive_at, bytes.size() - archive_at);
  if (std::memcmp(actual.data(), digest, actual.size()) != 0) {
    TDIST_THROW(Error, "the checkpoint is not readable: its archive does not match the digest in ",
                "its header (a damaged or truncated file)");
  }
  torch::serialize::InputArchive archive;
  TrainState state;
  try {
    // Every tensor onto the model's device: a parameter read onto another device would replace
    // the module's (InputArchive moves a parameter to the device it was read on).
    archive.load_from(bytes.data() + archive_at, bytes.size() - archive_at, device);
    state.step = read_int(archive, "step");
    state.epoch = read_int(archive, "epoch");
    state.epoch_position = read_int(archive, "epoch_position");
    state.world_size = read_int(archive, "world_size");
    state.last_loss = read_double(archive, "last_loss");
    state.last_train_accuracy = read_double(archive, "last_train_accuracy");
    at::Tensor rng;
    if (archive.try_read("rng_state", rng)) state.rng_state = rng.to(at::kCPU);
    torch::serialize::InputArchive model_archive;
    archive.read("model", model_archive);
    model.load(model_archive);
    torch::serialize::InputArchive optimizer_archive;
    archive.read("optimizer", optimizer_archive);
    optimizer.load(optimizer_archive);
  } catch (const Error&) {
    throw;  // read_int / read_double: an entry of the wrong type
  } catch (const c10::Error& e) {
    TDIST_THROW(Error, "the checkpoint is not readable: ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    // libtorch's archive reader throws more than c10::Error: torch::jit::ErrorReport for
    // TorchScript it cannot parse, for one.
    TDIST_THROW(Error, "the checkpoint is not readable: ", e.what());
  }
  return state;
}

}  // namespace tdist::train
