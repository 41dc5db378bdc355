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
//     resume] in trainer.cpp). The file starts with a header (magic "TDCKPT04", the
//     fingerprint as a u64 length and its bytes, the SHA-256 of the archive) before libtorch's
//     archive, so the fingerprint is checked before libtorch parses any of the file, and a
//     damaged or truncated archive is refused without libtorch ever reading it.
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
};

inline constexpr const char* kCheckpointFile = "checkpoint.pt";

std::string checkpoint_path(const std::string& dir);

// Rank 0: writes the checkpoint atomically (Note [Checkpoint protocol] 2). Creates `dir` if
// needed. Throws Error naming the file on any I/O failure (the previous checkpoint stays).
void save_checkpoint(const std::string& dir, const torch::nn::Module& model,
                     const torch::optim::Optimizer& optimizer, const TrainState& state,
                     const std::string& fingerprint);

// Rank 0 under fsdp or hsdp: writes checkpoint.pt with `state` (whose sharded_subdir must be
// set) and no model or optimizer (Note [Checkpoint protocol] 6), atomically as save_checkpoint.
void save_training_state(const std::string& dir, const TrainState& state,
                         const std::string& fingerprint);

// Rank 0: the bytes of <dir>/checkpoint.pt, or nullopt when there is none.
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
