#include "apps/train/checkpoint.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <openssl/crypto.h>

#include <cstring>
#include <sstream>

#include "tdist/comm/process_group.h"
#include "tdist/core/atomic_file.h"
#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/net/handshake.h"
#include "tdist/core/token.h"
#include "tdist/core/wire.h"
#include "tdist/fsdp/checkpoint.h"

namespace tdist::train {
namespace {

constexpr int64_t kNoCheckpoint = -1;
constexpr int64_t kReadFailed = -2;
// Note [Checkpoint protocol] 4: the file starts with kMagic (which also names the format
// version), the fingerprint's length (u64, little endian), the fingerprint, the digest's kind
// (u8, Note [Checkpoint key]) and the digest of libtorch's archive, which follows. The
// fingerprint and the digest are checked before libtorch parses anything: a damaged or
// truncated archive never reaches its reader (which leaks on some and throws what it likes on
// others).
constexpr char kMagic[8] = {'T', 'D', 'C', 'K', 'P', 'T', '0', '5'};
constexpr uint8_t kPlainDigest = 0;  // SHA-256
constexpr uint8_t kKeyedDigest = 1;  // HMAC-SHA256 keyed with the job's token
constexpr size_t kMaxFingerprint = 1 << 16;
// Rank 0 broadcasts a checkpoint in pieces of this size: the other ranks' memory grows with
// the bytes that arrived, never with a size rank 0 announced.
constexpr int64_t kShareChunk = int64_t(64) << 20;

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

// Note [Checkpoint key] (checkpoint.h): the key of this run's checkpoints, empty for none.
std::string checkpoint_key() {
  if (env::get_bool("TDIST_TOKEN_DRAWN", false)) return {};
  return load_token().value;
}

Sha256Digest archive_digest(const std::string& key, const char* data, size_t size) {
  if (key.empty()) return sha256(data, size);
  return net::hmac_sha256(key, reinterpret_cast<const uint8_t*>(data), size);
}

}  // namespace

std::string checkpoint_path(const std::string& dir) { return dir + "/" + kCheckpointFile; }

namespace {

// model and optimizer null: they are in the sharded checkpoint state.sharded_subdir names.
void save(const std::string& dir, const torch::nn::Module* model,
          const torch::optim::Optimizer* optimizer, const TrainState& state,
          const std::string& fingerprint) {
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
  if (model != nullptr) {
    torch::serialize::OutputArchive model_archive;
    model->save(model_archive);
    archive.write("model", model_archive);
    torch::serialize::OutputArchive optimizer_archive;
    optimizer->save(optimizer_archive);
    archive.write("optimizer", optimizer_archive);
  } else {
    archive.write("sharded", c10::IValue(state.sharded_subdir));
    if (!state.sharded_index_sha256.empty()) {
      archive.write("sharded_index", c10::IValue(state.sharded_index_sha256));
    }
  }
  std::ostringstream archive_bytes;
  archive.save_to(archive_bytes);
  const std::string body = archive_bytes.str();
  const std::string key = checkpoint_key();
  Bytes head;
  wire::Writer w(head);
  w.raw(kMagic, sizeof(kMagic));
  w.string(fingerprint);
  w.u8(key.empty() ? kPlainDigest : kKeyedDigest);
  const Sha256Digest digest = archive_digest(key, body.data(), body.size());
  w.raw(digest.data(), digest.size());
  check_private_directory(dir, /*create=*/true);
  // Note [Checkpoint protocol] 2: temporary file, fsync, rename, fsync the directory.
  write_file_atomically(checkpoint_path(dir),
                        {std::string_view(reinterpret_cast<const char*>(head.data()), head.size()),
                         std::string_view(body)});
}

}  // namespace

void save_checkpoint(const std::string& dir, const torch::nn::Module& model,
                     const torch::optim::Optimizer& optimizer, const TrainState& state,
                     const std::string& fingerprint) {
  save(dir, &model, &optimizer, state, fingerprint);
}

void save_training_state(const std::string& dir, const TrainState& state,
                         const std::string& fingerprint) {
  TDIST_CHECK_ARG(!state.sharded_subdir.empty(), "save_training_state: no sharded_subdir");
  save(dir, nullptr, nullptr, state, fingerprint);
}

std::string sharded_index_digest(const std::string& sharded_dir) {
  const std::string path = sharded_dir + "/" + fsdp::kIndexFile;
  const auto bytes = read_file(path);
  TDIST_CHECK(bytes.has_value(), "the sharded checkpoint has no ", path);
  return to_hex(sha256(bytes->data(), bytes->size()));
}

void check_sharded_index(const std::string& sharded_dir, const TrainState& state) {
  TDIST_CHECK(!state.sharded_index_sha256.empty(), "the checkpoint does not record the digest of ",
              sharded_dir, "/", fsdp::kIndexFile, " (Note [Checkpoint key]); start afresh");
  TDIST_CHECK(sharded_index_digest(sharded_dir) == state.sharded_index_sha256,
              "the sharded checkpoint is refused: ", sharded_dir, "/", fsdp::kIndexFile,
              " is not the index checkpoint.pt recorded (changed or replaced since it was "
              "written)");
}

std::optional<std::vector<char>> read_checkpoint_file(const std::string& dir) {
  if (!check_private_directory(dir, /*create=*/false)) return std::nullopt;
  return read_file(checkpoint_path(dir));
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
              : bytes             ? static_cast<int64_t>(bytes->size())
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

namespace {

TrainState load(const std::vector<char>& bytes, torch::nn::Module* model,
                torch::optim::Optimizer* optimizer, const std::string& fingerprint,
                c10::Device device) {
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  wire::Reader r(data, bytes.size());
  std::string saved;
  try {
    if (std::memcmp(r.raw(sizeof(kMagic), "header"), kMagic, sizeof(kMagic)) != 0) {
      throw ProtocolError(
          "it does not start with this version's header (not a tdist-train "
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
  if (r.remaining() < 1 + sizeof(Sha256Digest)) {
    TDIST_THROW(Error, "the checkpoint is not readable: it ends inside its header");
  }
  // Note [Checkpoint key].
  const uint8_t kind = r.u8("digest kind");
  const std::string key = checkpoint_key();
  if (kind != kPlainDigest && kind != kKeyedDigest) {
    TDIST_THROW(Error, "the checkpoint is not readable: unknown digest kind ", int(kind));
  }
  if (kind == kKeyedDigest && key.empty()) {
    TDIST_THROW(Error,
                "the checkpoint's digest is keyed with the job's token (HMAC-SHA256) and "
                "this run has none: resume with the TDIST_TOKEN or TDIST_TOKEN_FILE it was "
                "written with");
  }
  if (kind == kPlainDigest && !key.empty()) {
    TDIST_THROW(Error,
                "the checkpoint's digest is not keyed, and this run has the job's token: "
                "a checkpoint written without it is refused (anyone who could write its "
                "directory could have made it); resume it without a token, or start afresh");
  }
  const uint8_t* digest = r.raw(sizeof(Sha256Digest), "archive digest");
  const size_t archive_at = bytes.size() - r.remaining();
  const Sha256Digest actual =
      archive_digest(key, bytes.data() + archive_at, bytes.size() - archive_at);
  if (CRYPTO_memcmp(actual.data(), digest, actual.size()) != 0) {
    if (kind == kKeyedDigest) {
      TDIST_THROW(Error,
                  "the checkpoint is refused: its archive does not match the keyed digest "
                  "(HMAC-SHA256 with the job's token) in its header: written with another token, "
                  "changed, or damaged");
    }
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
    c10::IValue sharded;
    const bool is_sharded = archive.try_read("sharded", sharded);
    if (is_sharded != (model == nullptr)) {
      throw InvalidArgument(
          is_sharded ? "the checkpoint was written under --strategy fsdp or hsdp (its model and "
                       "optimizer are sharded); resume it with one of those"
                     : "the checkpoint was written under --strategy ddp (it holds the whole "
                       "model and optimizer); resume it with --strategy ddp");
    }
    if (is_sharded) {
      TDIST_CHECK(sharded.isString() && !sharded.toStringRef().empty() &&
                      sharded.toStringRef().find('/') == std::string::npos,
                  "checkpoint entry 'sharded' is not the name of a subdirectory");
      state.sharded_subdir = sharded.toStringRef();
      c10::IValue index;
      if (archive.try_read("sharded_index", index)) {
        TDIST_CHECK(index.isString(), "checkpoint entry 'sharded_index' is not a string");
        state.sharded_index_sha256 = index.toStringRef();
      }
    } else {
      torch::serialize::InputArchive model_archive;
      archive.read("model", model_archive);
      model->load(model_archive);
      torch::serialize::InputArchive optimizer_archive;
      archive.read("optimizer", optimizer_archive);
      optimizer->load(optimizer_archive);
    }
  } catch (const Error&) {
    throw;  // read_int / read_double: an entry of the wrong type; InvalidArgument
  } catch (const c10::Error& e) {
    TDIST_THROW(Error, "the checkpoint is not readable: ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    // libtorch's archive reader throws more than c10::Error: torch::jit::ErrorReport for
    // TorchScript it cannot parse, for one.
    TDIST_THROW(Error, "the checkpoint is not readable: ", e.what());
  }
  return state;
}

}  // namespace

TrainState load_checkpoint(const std::vector<char>& bytes, torch::nn::Module& model,
                           torch::optim::Optimizer& optimizer, const std::string& fingerprint,
                           c10::Device device) {
  return load(bytes, &model, &optimizer, fingerprint, device);
}

TrainState load_training_state(const std::vector<char>& bytes, const std::string& fingerprint) {
  return load(bytes, nullptr, nullptr, fingerprint, c10::Device(c10::kCPU));
}

}  // namespace tdist::train
