#pragma once
// tdist-train's pipeline parallelism (--pp-stages P --schedule S --microbatches M): the world is
// laid out as a comm::DeviceMesh {"pp": P, "dp": world / P} (Note [Device mesh layout]: stage s
// holds world ranks s * dp .. s * dp + dp - 1); each "pp" group runs one tdist::pipeline over the
// model's layers() cut into stages, and each stage's "dp" group runs DDP over that stage's
// chunks (armed by the pipeline before the last weight pass, so the gradients of all
// microbatches are reduced once), or (config.shard, --strategy fsdp) shards each chunk's
// parameters across that group: gathered once before the step, and the gradients of all
// microbatches reduce-scattered once after it (fsdp's ParamGroup; the optimizer steps the
// shards); or (config.shard_size, --strategy hsdp) shards each chunk within groups of
// shard_size replicas and replicates it across the groups, the reduce-scattered gradients then
// allreduced across them.
//
// The cut: a gpt's blocks are the stages' layers (stage 0 also holds the embedding, the last
// stage the final LayerNorm and head); a classifier's layers with parameters are, each with the
// parameter-free layers after it. Units are dealt in order, as evenly as they go, to the P
// stages (the interleaved schedule: to 2P virtual stages, two per rank).
//
// Every rank builds the whole model from the same seed and keeps only its stage's part of it:
// the other layers' parameters are dropped (empty tensors) at construction. Evaluation runs
// through the pipeline (eval(): forward only, each rank its stage), so no rank holds the whole
// model for it. sync_full_model() (a collective) gives every rank every stage's current values,
// for the final parameter hash; the next step() or eval() drops them again.
//
// Note [Pipelined checkpoints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// No rank holds the whole model or optimizer, so, as under fsdp (Note [Checkpoint protocol] 6
// in checkpoint.h): every rank writes its part (what its optimizer steps: its stage's
// parameters, or their shards, and the optimizer's state) as a checkpoint of its own, in
// save_checkpoint's format (header, fingerprint, digest; atomic), at
// <dir>/pipeline-<step>/rank-<world rank>/checkpoint.pt; a collective then checks that every
// rank wrote its part (else every rank fails, naming the ranks); then rank 0 writes
// checkpoint.pt with the training state naming pipeline-<step> and removes older pipeline-*
// subdirectories. A crash before that rename leaves the previous checkpoint.pt and the
// subdirectory it names. The run's fingerprint names the pipeline (stages, schedule, strategy),
// and each part's adds its rank and the mesh's shape, so resuming with another layout is
// refused with both shown. Resume shares checkpoint.pt (Note [Checkpoint protocol] 3), builds
// the pipeline (the DDP broadcast or the sharding first), then every rank loads its own part
// into the same tensors and optimizer. Replicas of a stage under DDP write equal parts; each
// writes its own all the same, so that no rank needs another's file, and a run under DDP
// resumes at another world size (the same stages, another number of replicas: the elastic
// case), each rank reading its stage's first replica's part. Sharded stages resume at the
// world size they were written at (a part per rank).
//
// Contract: construction, step(), eval() and sync_full_model() are collectives over the world,
// made in the same order on every rank; one thread drives the object; every wait is bounded by
// the timeout given at construction.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "apps/train/checkpoint.h"
#include "apps/train/models.h"
#include "tdist/ddp/options.h"

namespace tdist::comm {
class DeviceMesh;
}
namespace torch::optim {
class Optimizer;
}

namespace tdist::train {

struct PipelineConfig {
  int stages = 1;                 // --pp-stages
  std::string schedule = "1f1b";  // --schedule: gpipe, 1f1b, interleaved, zb
  int microbatches = 1;           // --microbatches (divides the batch of a replica)
  std::chrono::milliseconds timeout{300000};
  bool shard = false;  // --strategy fsdp or hsdp: shard each stage across its replicas
  // --strategy hsdp: a stage's replicas form groups of shard_size ranks (consecutive dp
  // coordinates), each holding the stage once in shards, replicated across the groups; 0: one
  // group of every replica (fsdp). It divides the number of replicas.
  int shard_size = 0;
  // --mixed-precision bf16 (sharded stages): each stage is gathered and computes in bf16 (its
  // shards, their gradients and the optimizer state stay fp32), so the activations and their
  // gradients travel between stages as bf16; the first stage's floating inputs are cast to it.
  bool bf16 = false;
};

// One step of the pipeline, as this rank saw it.
struct PipelineStepResult {
  bool has_loss = false;           // this rank holds the last stage
  double loss = 0;                 // the mean loss over the batch (last stage)
  int64_t correct = 0;             // right predictions of the batch (last stage)
  int64_t predictions = 0;         // predictions made (last stage)
  double compute_forward_ms = 0;   // time in forward actions (F)
  double compute_backward_ms = 0;  // time in backward actions (B, I, W)
  double idle_ms = 0;              // the rest of the step: waiting for neighbours and sends
};

class PipelineStrategy {
 public:
  // Collective over the mesh's world: the pipeline's and DDP's groups (`ddp_options`, its
  // timeout replaced by the config's). `loss(output, labels)` is the mean loss of one
  // microbatch. InvalidArgument when the model has fewer units than virtual stages, or when the
  // schedule name is unknown.
  PipelineStrategy(TrainModel model, bool language_model, std::shared_ptr<comm::DeviceMesh> mesh,
                   PipelineConfig config,
                   std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss,
                   ddp::DDPOptions ddp_options);
  ~PipelineStrategy();
  PipelineStrategy(const PipelineStrategy&) = delete;
  PipelineStrategy& operator=(const PipelineStrategy&) = delete;

  // What the optimizer steps: this rank's stage's parameters, or (sharded) their shards.
  std::vector<at::Tensor> parameters() const;
  // --strategy fsdp: parameters() are shards.
  bool sharded() const;
  // One pipeline step: `inputs` and `labels` are this replica's batch (the same on every stage
  // of the pipeline); gradients land in parameters()' .grad, averaged over the replicas.
  PipelineStepResult step(const at::Tensor& inputs, const at::Tensor& labels);
  // Collective over this rank's pipeline (its "pp" group; Pipeline::eval): the forward of one
  // batch, shaped like step()'s (a shorter one must be filled up), without autograd. Returns
  // the logits on the last stage's rank, an undefined tensor on the others. Sharded stages are
  // gathered for it and resharded after.
  at::Tensor eval(const at::Tensor& inputs);
  // Collective: every rank's model gets every stage's current parameters (a broadcast from each
  // stage's rank within each pipeline; sharded stages are gathered first, in the model's
  // dtype). They stay until the next step() or eval().
  void sync_full_model();
  // Checkpoints (Note [Pipelined checkpoints]): this rank's part, what parameters() returns and
  // `optimizer`'s state, written as a checkpoint of its own in <dir>/rank-<world rank> (local:
  // no communication; Error naming the file on failure), and read back from there into the same
  // tensors and optimizer (InvalidArgument when the file is missing or was written by another
  // rank, layout or run: `fingerprint` holds those).
  void save_part(const std::string& dir, int world_rank, const torch::optim::Optimizer& optimizer,
                 const TrainState& state, const std::string& fingerprint) const;
  void load_part(const std::string& dir, int world_rank, torch::optim::Optimizer& optimizer,
                 const std::string& fingerprint);
  // "pp 2 x dp 2, 1f1b, 4 microbatches; stage 1 (rank 1, layers [3, 6))"; under hsdp the dp
  // part reads "dp 4 (2 replicas of shard groups of 2)".
  std::string describe() const;

 private:
  // Empties the parameters of the layers outside this rank's stage (and reshards its own).
  void drop_others();
  // Before a step or an eval: drops what sync_full_model() gathered, gathers the sharded
  // stages, and sets the pipeline up at the first call (`inputs`: a batch's shape). Returns the
  // inputs in the dtype the first stage computes in (config.bf16).
  at::Tensor prepare(const at::Tensor& inputs);

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tdist::train
