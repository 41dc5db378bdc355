#pragma once
// Checkpoints of a tdist-train run: model, optimizer, step, sampler position and RNG state.
//
// Note [Checkpoint protocol]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
//  1. After a DDP step every rank holds the same parameters and optimizer state (the gradients
//     were averaged, the optimizers are deterministic), so rank 0's copy is everyone's: rank 0
//     alone writes <dir>/checkpoint.pt, after the optimizer step of every --checkpoint-every'th
//     step and at the end of training.
//  2. The write is atomic: a temporary file in the same directory is written, flushed and
//     fsync'ed, then renamed over checkpoint.pt, and the directory is fsync'ed. A crash at any
//     moment leaves either the previous checkpoint or the new one, never a torn file
//     (write_file_atomically, tdist/core/atomic_file.h; fsdp's checkpoints use it too).
//  3. --resume: rank 0 reads the file and broadcasts its bytes over the process group (a size,
//     then the bytes; size -1 means "no checkpoint", -2 "rank 0 could not read it"), and every
//     rank loads the same bytes. Only rank 0 needs the directory (no shared file system).
//  4. The checkpoint records the run's fingerprint (model, optimizer, batch size per rank,
//     seed, data): everything that must stay the same for the resumed run to continue where
//     the interrupted one left off. A different fingerprint is refused with both shown. The
//     world size is not part of it: a run may resume at another world size (Note [Elastic
//     resume] in trainer.cpp). The file starts with a header (magic "TDCKPT05", the
//     fingerprint as a u64 length and its bytes, the digest's kind and the digest of the
//     archive, Note [Checkpoint key]) before libtorch's archive, so the fingerprint is checked
//     before libtorch parses any of the file, and a damaged, truncated or forged archive is
//     refused without libtorch ever reading it.
//  5. The sampler position (epoch, samples of it consumed) and the step determine the next
//     batch on every rank; with the RNG state restored, a run resumed at the same world size
//     computes exactly the steps the interrupted one would have.
//  6. --strategy fsdp and hsdp: no rank holds the whole model or optimizer, so they go into a
//     sharded checkpoint (tdist/fsdp/checkpoint.h: every rank writes its shards, and it loads
//     at any world or shard size) in the subdirectory sharded-<step> of the directory, written
//     by every rank (a collective that ends once all succeeded); then rank 0 writes
//     checkpoint.pt as in 1-4 with the training state and that subdirectory's name instead of
//     the model and optimizer (save_training_state), and removes the other sharded-*
//     subdirectories. A crash before the rename leaves the previous checkpoint.pt and the
//     subdirectory it names. Resume shares checkpoint.pt as in 3 (load_training_state), wraps
//     the model, then every rank loads the sharded checkpoint it names (so the directory must
//     be readable by every rank: a shared file system, or one machine). A checkpoint of ddp is
//     refused under fsdp or hsdp and the other way round (InvalidArgument naming the strategy).
//
// Note [Checkpoint key]
// ~~~~~~~~~~~~~~~~~~~~~
// A checkpoint is code and data the next run loads, so who can plant one matters. The directory
// is checked before every write and read (check_private_directory, core/atomic_file.h: ours,
// not group- or world-writable, not a symbolic link; made 0700 when missing) and the file is
// written 0600. The archive's digest is HMAC-SHA256 keyed with the job's token (core/token.h)
// when the run has one the user gave (TDIST_TOKEN, TDIST_TOKEN_FILE, tdist-run --token-file),
// and a plain SHA-256 when it has none, as before. Not with the token tdist-run draws for a
// single-node run (it marks it TDIST_TOKEN_DRAWN=1): that one changes with every launch, so no
// later run could resume. A run with a token refuses a checkpoint whose keyed digest fails
// (another token, a changed file) and one with a plain digest (anyone who could write the
// directory could have made it); a run without a token refuses a keyed one, naming the token
// variables. Each refusal is an Error naming the reason (exit 1 in tdist-train). Under fsdp and
// hsdp checkpoint.pt holds no tensors but records the SHA-256 of the sharded checkpoint's
// index.json (TrainState::sharded_index_sha256), and the index holds every shard's digest, which
// fsdp checks as it loads: the keyed digest covers the shards through that chain, and an index
// that differs from the recorded one is refused before anything is loaded.
//
// Plain functions, blocking (file I/O; share_checkpoint is a collective).

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}
namespace tdist::comm {
class ProcessGroup;
}

namespace tdist::train {

struct TrainState {
  int64_t step = 0;            // optimizer steps done
  int64_t epoch = 0;           // sampler position of the next batch: its epoch,
  int64_t epoch_position = 0;  // and the samples of that epoch already consumed (all ranks)
  int64_t world_size = 0;      // of the run that wrote the checkpoint
  at::Tensor rng_state;        // libtorch's default CPU generator (undefined: leave it)
  double last_loss = -1;       // the last reported training loss (negative: none yet)
  double last_train_accuracy = -1;
  // fsdp, hsdp: the subdirectory of the checkpoint directory with the sharded model and
  // optimizer (Note [Checkpoint protocol] 6); empty: checkpoint.pt holds them.
  std::string sharded_subdir;
  // fsdp, hsdp: SHA-256 (hex) of that checkpoint's index.json, which holds the digest of every
  // shard: under checkpoint.pt's keyed digest the chain to each shard is keyed too (Note
  // [Checkpoint key]). Empty for a pipelined run (its parts are checkpoints of their own).
  std::string sharded_index_sha256;
};

// The hex SHA-256 of <sharded_dir>/index.json (fsdp::kIndexFile) for TrainState; Error naming
// the file when it cannot be read.
std::string sharded_index_digest(const std::string& sharded_dir);

// Before a sharded checkpoint is loaded: its index.json must be the one checkpoint.pt recorded
// (`state.sharded_index_sha256`); Error saying so otherwise.
void check_sharded_index(const std::string& sharded_dir, const TrainState& state);

inline constexpr const char* kCheckpointFile = "checkpoint.pt";

std::string checkpoint_path(const std::string& dir);

// Rank 0: writes the checkpoint atomically (Note [Checkpoint protocol] 2) into `dir`, created
// 0700 if needed and checked (Note [Checkpoint key]: InvalidArgument when another user or group
// could write it). Throws Error naming the file on any I/O failure (the previous checkpoint
// stays).
void save_checkpoint(const std::string& dir, const torch::nn::Module& model,
                     const torch::optim::Optimizer& optimizer, const TrainState& state,
                     const std::string& fingerprint);

// Rank 0 under fsdp or hsdp: writes checkpoint.pt with `state` (whose sharded_subdir must be
// set) and no model or optimizer (Note [Checkpoint protocol] 6), atomically as save_checkpoint.
void save_training_state(const std::string& dir, const TrainState& state,
                         const std::string& fingerprint);

// Rank 0: the bytes of <dir>/checkpoint.pt, or nullopt when there is none (or no `dir`); the
// directory is checked as for writing (Note [Checkpoint key]).
std::optional<std::vector<char>> read_checkpoint_file(const std::string& dir);

// Collective: rank 0 passes what read_checkpoint_file returned (or an error message), every rank
// gets the same bytes (Note [Checkpoint protocol] 3); nullopt when there is no checkpoint.
std::optional<std::vector<char>> share_checkpoint(comm::ProcessGroup& pg,
                                                  const std::optional<std::vector<char>>& bytes,
                                                  const std::string& read_error,
                                                  std::chrono::milliseconds timeout);

// Loads the checkpoint into `model` and `optimizer` and returns the state (the caller restores
// rng_state). The model's and the optimizer's tensors are read onto `device` (the model's), so a
// checkpoint written on one device resumes on another; rng_state stays on the host. Throws
// InvalidArgument when the fingerprint differs (nothing is changed then) and Error when the
// bytes are not a checkpoint, or not an intact one (its digest does not match).
TrainState load_checkpoint(const std::vector<char>& bytes, torch::nn::Module& model,
                           torch::optim::Optimizer& optimizer, const std::string& fingerprint,
                           c10::Device device = c10::Device(c10::kCPU));

// The training state of a checkpoint save_training_state wrote (its sharded_subdir names the
// sharded checkpoint), with load_checkpoint's checks. InvalidArgument also when the checkpoint
// holds a whole model (written under ddp); load_checkpoint refuses a sharded one likewise.
TrainState load_training_state(const std::vector<char>& bytes, const std::string& fingerprint);

}  // namespace tdist::train
