#pragma once
// The training loop of tdist-train: builds the process group, the data, the model wrapped for
// its --strategy (DistributedDataParallel; fully_shard; DDP with a ZeroRedundancyOptimizer) and
// the optimizer, then trains, evaluates, checkpoints and reports.
//
// Every rank runs run_training() with the same options. Collectives happen at the same steps on
// every rank: the strategy's forward, backward and step collectives each step, a small allreduce
// of the loss and accuracy at each log point, the evaluation's forwards (under fsdp every rank
// runs as many) and allreduce at each evaluation, the checkpoint broadcast on resume, and the
// memory report's allreduce at the end. Blocking; returns when training is done.

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

#include "apps/train/data.h"
#include "apps/train/models.h"
#include "tdist/ddp/options.h"

namespace tdist::train {

struct TrainOptions {
  ModelConfig model;
  DataConfig data;
  std::string optimizer = "sgd";  // "sgd" or "adam"
  double lr = 0.0;                // 0: the optimizer's default (sgd 0.05, adam 0.001)
  double momentum = 0.9;          // sgd
  double weight_decay = 0.0;
  int64_t epochs = 0;  // exactly one of epochs and steps is > 0
  int64_t steps = 0;
  int64_t batch_size = 64;  // per rank (per data-parallel replica with pp_stages > 1)
  uint64_t seed = 0;
  // "ddp" (every rank holds everything), "fsdp" (fully_shard: the model's units and the rest
  // sharded), "hsdp" (fully_shard inside groups of shard_size ranks, replicated across them) or
  // "zero1" (DDP with the optimizer state sharded: ZeroRedundancyOptimizer).
  std::string strategy = "ddp";
  bool reshard_after_forward = true;     // fsdp, hsdp: FSDPOptions::reshard_after_forward
  int shard_size = 0;                    // hsdp: FSDPOptions::shard_size (>= 1, divides the world)
  std::string mixed_precision = "none";  // fsdp, hsdp: "bf16" gathers and computes in bf16
  // fsdp or hsdp: the model is wrapped by fully_shard.
  bool sharded() const { return strategy == "fsdp" || strategy == "hsdp"; }
  // Pipeline parallelism (apps/train/pipeline_strategy.h): pp_stages > 1 lays the world out as
  // pp_stages x (world / pp_stages), a pipeline of that many stages per data-parallel replica
  // (--strategy ddp across the replicas); batch_size is then per replica, cut into microbatches.
  int pp_stages = 1;
  std::string schedule = "1f1b";  // gpipe, 1f1b, interleaved, zb
  int microbatches = 1;
  ddp::DDPOptions ddp;
  std::string comm_hook = "allreduce";  // allreduce, fp16, bf16, powersgd
  int powersgd_rank = 1;
  double timeout_s = 300;  // of every collective (process group and DDP)
  // Where the model, its gradients, the optimizer state and the batches live (--device, resolved
  // by apps/common/device.h before run_training).
  c10::Device device = c10::Device(c10::kCPU);
  // The process group's backend (comm::ProcessGroup::Options::backend): "ring", or one per
  // device type such as "cpu:ring,cuda:nccl".
  std::string group_backend = "auto";
  int threads = 0;  // intra-op threads (0: libtorch's default / OMP_NUM_THREADS)
  int64_t log_every = 10;
  int64_t eval_every = 0;  // 0: evaluate at the end only
  int64_t eval_batch_size = 1000;
  int64_t warmup_steps = 5;       // excluded from the summary's samples_per_sec
  std::string progress = "auto";  // auto, bar, log, none
  std::string metrics_path;
  std::string summary_path;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;  // 0: only at the end (when checkpoint_dir is set)
  bool resume = false;
};

// The default learning rate of an optimizer.
double default_lr(const std::string& optimizer);

// Checks what can be checked before any data or peer is touched; InvalidArgument (exit 2).
void validate(const TrainOptions& opts);

// Runs training on this rank. Rank and world come from the environment (tdist-run, torchrun,
// SLURM, Open MPI; see core/env.h); without any, a single process trains alone.
// Throws InvalidArgument for bad input (data, checkpoint of another run) and Error otherwise.
void run_training(const TrainOptions& opts);

}  // namespace tdist::train
