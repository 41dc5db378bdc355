#include "apps/train/trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <signal.h>
#include <sys/resource.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>
#include <unordered_set>
#include <nlohmann/json.hpp>

#include "apps/train/checkpoint.h"
#include "apps/train/pipeline_strategy.h"
#include "apps/train/progress.h"
#include "apps/train/test_hook.h"
#include "tdist/core/atomic_file.h"
#include "tdist/core/cpu_memory.h"
#include "tdist/core/hash.h"
#include "tdist/comm/device_mesh.h"
#include "tdist/comm/process_group.h"
#include "tdist/core/env.h"
#include "tdist/core/hash_store.h"
#include "tdist/core/logging.h"
#include "tdist/ddp/distributed_data_parallel.h"
#include "tdist/fsdp/checkpoint.h"
#include "tdist/fsdp/fully_shard.h"
#include "tdist/fsdp/zero_redundancy_optimizer.h"
#include "tdist/pipeline/schedule.h"

namespace tdist::train {
namespace {

using Clock = std::chrono::steady_clock;
using Model = ddp::DistributedDataParallel<TrainModel>;
using ShardedModel = fsdp::FullyShardedModule<TrainModel>;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch())
      .count();
}

std::chrono::milliseconds timeout_of(const TrainOptions& o) {
  return std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000.0));
}

// The group of this job. Without RANK (nor SLURM's or Open MPI's variables) the process trains
// alone over an in-process store, so `tdist-train ...` works without a launcher.
std::shared_ptr<comm::ProcessGroup> make_group(const TrainOptions& o) {
  comm::ProcessGroup::Options popts;
  popts.timeout = timeout_of(o);
  popts.backend = o.group_backend;
  // On a GPU the NCCL group is bound to it and connects now, as c10d's device_id does.
  if (o.device.is_cuda() && o.device.has_index()) popts.device_id = o.device.index();
  if (!env::has_dist_env()) {
    return comm::create_process_group(std::make_shared<HashStore>(), 0, 1, popts);
  }
  return comm::create_process_group("env://", -1, -1, popts);
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainOptions& o,
                                                        const std::vector<at::Tensor>& params) {
  const double lr = o.lr > 0 ? o.lr : default_lr(o.optimizer);
  if (o.optimizer == "sgd") {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(lr).momentum(o.momentum).weight_decay(o.weight_decay));
  }
  return std::make_unique<torch::optim::Adam>(
      params, torch::optim::AdamOptions(lr).weight_decay(o.weight_decay));
}

// The comm hook for --comm-hook; null for "allreduce" (DDP's built-in path is faster than any
// registered hook).
ddp::CommHook make_hook(const TrainOptions& o) {
  if (o.comm_hook == "fp16") return ddp::fp16_compress_hook();
  if (o.comm_hook == "bf16") return ddp::bf16_compress_hook();
  if (o.comm_hook == "powersgd") {
    ddp::PowerSGDOptions p;
    p.matrix_approximation_rank = o.powersgd_rank;
    p.seed = o.seed;
    return ddp::powersgd_hook(p);
  }
  return nullptr;
}

// When backward computed the last parameter gradient (a tensor hook on every parameter, which
// runs as its gradient is produced, before DDP's accumulator hooks). From then until backward
// returns the rank only waits for communication (and DDP copies the averages back).
struct GradTiming {
  std::atomic<int64_t> last_grad_us{0};
};

void watch_gradients(const std::vector<at::Tensor>& params,
                     const std::shared_ptr<GradTiming>& timing) {
  for (at::Tensor p : params) {
    p.register_hook([t = timing](const at::Tensor&) {
      t->last_grad_us.store(now_us(), std::memory_order_relaxed);
    });
  }
}

// Note [Elastic resume]
// ~~~~~~~~~~~~~~~~~~~~~
// tdist-run --nnodes MIN:MAX restarts the workers with a new world size when nodes leave or
// join, and they resume from the last checkpoint. So a run's position is counted in samples,
// not in steps of one world size:
//  1. The epoch's permutation does not depend on the world size, and a step consumes
//     batch x world consecutive samples of it (DistributedSampler, data.h). The checkpoint holds
//     (epoch, samples of it consumed); a run resumed at another world size goes on with the
//     next unconsumed sample, so every sample of an epoch is used once whatever the membership
//     history (but for the incomplete last step of each epoch, dropped).
//  2. --batch-size is per rank, as in PyTorch: the global batch follows the world size; the
//     learning rate is left alone (scaling it is the user's choice, as under torchrun).
//  3. --epochs ends the run at the end of that epoch, whatever world sizes it went through (the
//     total steps are recomputed at resume); --steps counts optimizer steps of any world size.
//  4. The world size is not in the fingerprint (Note [Checkpoint protocol] 4); the final
//     parameters are a function of the membership history (the checkpointed step at which each
//     world size took over): the same history gives bit-equal parameters, and at an unchanged
//     world size resume stays exact.

// Everything that must match for a resumed run to continue (Note [Checkpoint protocol] 4).
std::string fingerprint(const TrainOptions& o, int64_t train_size) {
  return str("model=", describe_model(o.model), " optimizer=", o.optimizer,
             " lr=", o.lr > 0 ? o.lr : default_lr(o.optimizer), " momentum=", o.momentum,
             " weight_decay=", o.weight_decay, " batch_size=", o.batch_size, " seed=", o.seed,
             " dataset=", o.data.dataset, " train_samples=", train_size,
             o.data.dataset == "synthetic" ? str(" signal=", o.data.signal) : std::string(),
             " comm_hook=", o.comm_hook,
             o.pp_stages > 1 ? str(" pipeline=", o.pp_stages, "/", o.schedule, "/", o.strategy,
                                   o.strategy == "hsdp" ? str("/", o.shard_size) : std::string())
                             : std::string());
}

// FNV-1a over the bytes of every parameter, in order: equal iff the parameters are bit-equal
// (up to hash collisions). Parameters on a GPU are hashed from a host copy.
uint64_t params_hash(const std::vector<at::Tensor>& params) {
  uint64_t h = kFnv1aOffset;
  for (const auto& p : params) {
    at::Tensor c = p.detach().to(at::kCPU).contiguous();
    h = fnv1a64(c.data_ptr(), c.nbytes(), h);
  }
  return h;
}

std::string hex64(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

at::Tensor rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(const at::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

struct EvalResult {
  double accuracy = std::nan("");  // of the predictions (images; next bytes)
  double loss = std::nan("");      // language model: mean cross-entropy per predicted byte
  int64_t samples = 0;
};

// Who evaluates which test samples, and how.
struct EvalShare {
  int part = 0;   // this rank's share: samples part, part + parts, ...
  int parts = 1;  // the world, or (pipelines) the replicas: a pipeline's stages share one part
  int64_t batch_size = 1;
  // A pipeline's batches keep the shape it was set up with: a short one is filled up with
  // repeats of its last sample, whose predictions are dropped.
  bool fixed_batches = false;
  // fsdp, whose forward is a collective: every rank runs the same number of forwards, a rank
  // out of samples running one on sample 0 whose result it drops.
  bool lockstep = false;
};

// Collective over `pg`: each rank evaluates its share of the test samples; the sums are added
// up (on the host: a CPU tensor whatever `device` the model is on). `forward` returns a batch's
// logits, or an undefined tensor where this rank computes none (a pipeline's stages but the
// last): such a rank counts nothing.
EvalResult evaluate(const std::function<at::Tensor(const at::Tensor&)>& forward,
                    torch::nn::Module& model, const Dataset& test, comm::ProcessGroup& pg,
                    const EvalShare& share, std::chrono::milliseconds timeout, c10::Device device,
                    bool language_model) {
  torch::NoGradGuard no_grad;
  model.eval();
  double correct = 0, predictions = 0, loss_sum = 0, samples = 0;
  std::vector<int64_t> idx;
  auto run = [&](bool counted) {
    const auto real = static_cast<int64_t>(idx.size());
    if (idx.empty()) idx.push_back(0);
    if (share.fixed_batches) idx.resize(static_cast<size_t>(share.batch_size), idx.back());
    Batch b = test.get(idx);
    at::Tensor logits = forward(b.images.to(device));
    if (counted && logits.defined()) {
      // Counted in fp32 whatever the model computes in (bf16 under --mixed-precision).
      logits = logits.narrow(0, 0, real).to(at::kFloat);
      at::Tensor labels = b.labels.narrow(0, 0, real).to(device);
      correct += logits.argmax(-1).eq(labels).sum().item<double>();
      predictions += static_cast<double>(labels.numel());
      if (language_model) loss_sum += loss_of(logits, labels, torch::kSum).item<double>();
      samples += static_cast<double>(real);
    }
    idx.clear();
  };
  int64_t batches = 0;
  for (int64_t i = share.part; i < test.size(); i += share.parts) {
    idx.push_back(i);
    if (static_cast<int64_t>(idx.size()) == share.batch_size) {
      run(true);
      ++batches;
    }
  }
  if (!idx.empty()) {
    run(true);
    ++batches;
  }
  if (share.lockstep && test.size() > 0) {
    const int64_t per_rank = (test.size() + share.parts - 1) / share.parts;
    for (int64_t k = batches; k < (per_rank + share.batch_size - 1) / share.batch_size; ++k) {
      run(false);
    }
  }
  model.train();
  at::Tensor sums = at::tensor({correct, predictions, loss_sum, samples}, at::kDouble);
  comm::AllreduceOptions opts;
  opts.timeout = timeout;
  pg.allreduce(sums, opts)->wait();
  EvalResult r;
  r.samples = static_cast<int64_t>(sums[3].item<double>());
  const double n = sums[1].item<double>();
  if (n > 0) {
    r.accuracy = sums[0].item<double>() / n;
    if (language_model) r.loss = sums[2].item<double>() / n;
  }
  return r;
}

// Bytes a rank holds for the model, measured from the tensors (each storage once).
struct MemoryUse {
  int64_t parameter_bytes = 0;
  int64_t gradient_bytes = 0;
  int64_t optimizer_state_bytes = 0;
  int64_t peak_rss_bytes = 0;  // the process's peak resident set (getrusage): everything
  // The most bytes of CPU tensors held at once since the model was built, less those held just
  // before (the data): from the counting allocator (core/cpu_memory.h). -1 on a GPU.
  int64_t peak_allocated_bytes = -1;
  // The activations: the most CPU tensor bytes one step's forward and loss added (held when its
  // backward began, less what was held before its forward). -1 on a GPU or without such a step.
  int64_t activation_bytes = -1;
};

int64_t storage_bytes(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<const void*> seen;
  int64_t bytes = 0;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.has_storage()) continue;
    const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    if (seen.insert(s).second) bytes += static_cast<int64_t>(s->nbytes());
  }
  return bytes;
}

std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.grad());
  return out;
}

int64_t peak_rss_bytes() {
  struct rusage ru {};
  if (::getrusage(RUSAGE_SELF, &ru) != 0) return -1;
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;  // kilobytes on Linux
}

// Sums over the steps since the last report.
struct Window {
  int64_t steps = 0;
  double loss_sum = 0;
  int64_t correct = 0;
  int64_t predictions = 0;  // images, or predicted bytes
  int64_t samples = 0;
  double step_s = 0;
  double data_ms = 0, forward_ms = 0, backward_ms = 0, comm_wait_ms = 0, optimizer_ms = 0;
};

std::string format_mb(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", static_cast<double>(bytes) / 1e6);
  return buf;
}

nlohmann::json number_or_null(double v) {
  return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr);
}

}  // namespace

double default_lr(const std::string& optimizer) { return optimizer == "adam" ? 1e-3 : 0.05; }

void validate(const TrainOptions& o) {
  auto bad = [](const std::string& msg) { throw InvalidArgument(msg); };
  if (o.optimizer != "sgd" && o.optimizer != "adam")
    bad("--optimizer must be sgd or adam (got '" + o.optimizer + "')");
  if ((o.epochs > 0) == (o.steps > 0)) bad("give exactly one of --epochs and --steps");
  if (o.comm_hook != "allreduce" && o.comm_hook != "fp16" && o.comm_hook != "bf16" &&
      o.comm_hook != "powersgd")
    bad("--comm-hook must be allreduce, fp16, bf16 or powersgd (got '" + o.comm_hook + "')");
  if (o.resume && o.checkpoint_dir.empty()) bad("--resume needs --checkpoint-dir");
  if (o.checkpoint_every > 0 && o.checkpoint_dir.empty())
    bad("--checkpoint-every needs --checkpoint-dir");
  if (o.data.dataset == "synthetic" && !o.data.data_dir.empty())
    bad("--data-dir is for --dataset mnist (the synthetic dataset reads no files)");
  if (o.data.dataset == "mnist" && o.data.data_dir.empty())
    bad("--dataset mnist needs --data-dir DIR (with the MNIST IDX files)");
  if (o.data.dataset == "synthetic" && (o.data.train_samples < 1 || o.data.test_samples < 1))
    bad("the synthetic dataset needs --train-samples and --test-samples >= 1");
  if (is_language_model(o.model) != (o.data.dataset == "text"))
    bad(is_language_model(o.model)
            ? "--model gpt trains on --dataset text (got --dataset " + o.data.dataset + ")"
            : "--dataset text needs --model gpt (got --model " + o.model.kind + ")");
  if (o.strategy != "ddp" && !o.sharded() && o.strategy != "zero1")
    bad("--strategy must be ddp, fsdp, hsdp or zero1 (got '" + o.strategy + "')");
  if ((o.strategy == "hsdp") != (o.shard_size != 0))
    bad(o.strategy == "hsdp" ? "--strategy hsdp needs --shard-size N (ranks per shard group)"
                             : "--shard-size applies to --strategy hsdp only");
  if (o.shard_size < 0) bad("--shard-size must be >= 1");
  if (o.mixed_precision != "none" && o.mixed_precision != "bf16")
    bad("--mixed-precision must be none or bf16 (got '" + o.mixed_precision + "')");
  if (o.mixed_precision != "none" && !o.sharded())
    bad("--mixed-precision applies to --strategy fsdp or hsdp only");
  if (o.sharded() && o.comm_hook != "allreduce")
    bad("--comm-hook is DDP's: it applies to --strategy ddp or zero1, not " + o.strategy);
  if (!o.sharded() && !o.reshard_after_forward)
    bad("--reshard-after-forward applies to --strategy fsdp or hsdp only");
  if (o.pp_stages < 1) bad("--pp-stages must be >= 1");
  if (o.microbatches < 1) bad("--microbatches must be >= 1");
  if (o.pp_stages > 1) {
    pipeline::parse_schedule(o.schedule);  // InvalidArgument naming the known ones
    if (o.strategy == "zero1")
      bad("--pp-stages runs DDP, FSDP or HSDP across the pipelines' replicas: --strategy zero1 "
          "is not supported with it (use --strategy ddp, fsdp or hsdp)");
    if (!o.reshard_after_forward)
      bad("--reshard-after-forward does not apply to --pp-stages > 1 (a sharded stage is "
          "gathered once per step, for all its microbatches)");
    if (o.comm_hook != "allreduce") bad("--comm-hook does not apply to --pp-stages > 1");
    if (o.batch_size % o.microbatches != 0)
      bad(str("--microbatches ", o.microbatches, " does not divide --batch-size ", o.batch_size,
              " (the batch of each pipeline)"));
  } else if (o.microbatches != 1 || o.schedule != "1f1b") {
    bad("--microbatches and --schedule apply to --pp-stages > 1 only");
  }
  parse_progress_mode(o.progress);
  describe_model(o.model);  // checks the model's settings
}

namespace {

// One run on this rank, phase by phase: run_training() below calls them in order (set up,
// resume, train epoch after epoch, finish), and every rank makes the same collective calls in
// the same order: DDP's broadcast when training starts and its allreduce every backward, the
// small allreduce of each log point, each evaluation's allreduce, the checkpoint broadcast of
// resume and the final barrier.
class Trainer {
 public:
  // Phase 1, set up: data first (a bad directory or file fails at once on every rank, before
  // any rendezvous), then the group, the sampler, and the model and its optimizer, seeded.
  explicit Trainer(const TrainOptions& o);
  // Phase 2, resume (--resume): every rank loads the checkpoint rank 0 read
  // (Note [Checkpoint protocol] 3), or starts from step 0 when there is none.
  void resume();
  // Wraps the model for --strategy (DDP and fully_shard broadcast rank 0's parameters: after
  // resume), makes fsdp's optimizer over the shards or zero1's ZeroRedundancyOptimizer, and
  // starts the clock of the training phase.
  void start_training();
  bool done() const { return state_.step >= total_steps_; }
  // Phase 3, train an epoch: the steps from the current one to the end of its epoch (or of
  // training), each followed by its log point, evaluation and checkpoint when they are due.
  void train_epoch();
  // Phase 5, finish: the last checkpoint, the final evaluation, the summary file and the line
  // with the parameter hash, then a barrier (rank 0 hosts the store: nobody leaves while
  // another rank may still need it).
  void finish();

 private:
  void train_step(const std::vector<int64_t>& epoch_order);
  // The strategy's forward (DDP's or the sharded model's), zero_grad and optimizer step.
  at::Tensor forward(const at::Tensor& inputs);
  void zero_grad();
  void optimizer_step();
  // What this rank holds for the model now, measured (MemoryUse).
  MemoryUse measure_memory() const;
  // A collective: every rank's MemoryUse, by rank.
  std::vector<MemoryUse> memory_per_rank(const MemoryUse& mine) const;
  // Moves the sampler position to the next epoch when no step fits in this one.
  void roll_over_epoch();
  // The step training ends at, from the current position (Note [Elastic resume] 3).
  int64_t planned_steps() const;
  void report_window(int64_t epoch);
  // Phase 4, evaluate: the test set across all ranks, reported at state_.step.
  EvalResult evaluate_now();
  void save();
  // Note [Pipelined checkpoints] (pipeline_strategy.h): this rank's part into `dir`, then a
  // collective: Error on every rank unless every rank wrote its part.
  void save_pipeline_parts(const std::string& dir);
  // The fingerprint of the part world rank `rank` wrote: the run's, the rank and the mesh's
  // shape (dp_size replicas of each stage).
  std::string part_fingerprint(int rank, int dp_size) const;
  void write_summary(const EvalResult& final_eval, double train_s, uint64_t hash,
                     const std::vector<MemoryUse>& memory) const;

  // Constant after set up.
  const TrainOptions& o_;
  DataSplits data_;
  std::shared_ptr<comm::ProcessGroup> pg_;
  int rank_ = 0;
  int world_ = 1;
  // --pp-stages > 1: the world as {"pp", "dp"} (else null); the data-parallel size and this
  // rank's replica (world and rank without pipeline stages): the sampler's split.
  std::shared_ptr<comm::DeviceMesh> mesh_;
  int dp_size_ = 1;
  int dp_rank_ = 0;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<Progress> progress_;
  std::unique_ptr<DistributedSampler> sampler_;
  int64_t steps_per_epoch_ = 0;  // of a whole epoch at this world size
  int64_t total_steps_ = 0;
  TrainModel model_;
  // ddp: over the parameters; fsdp: over the shards (made by start_training); zero1: none
  // (but from resume to start_training: the whole optimizer a checkpoint holds).
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::string fingerprint_;
  int64_t num_params_ = 0;
  TestHook test_hook_;  // apps/train/test_hook.h

  // Resume.
  TrainState state_;
  int64_t resumed_from_ = -1;
  int64_t saved_step_ = -1;

  // Training.
  std::unique_ptr<Model> ddp_model_;                     // ddp, zero1
  std::unique_ptr<ShardedModel> sharded_;                // fsdp
  std::unique_ptr<fsdp::ZeroRedundancyOptimizer> zero_;  // zero1
  std::unique_ptr<PipelineStrategy> pipeline_;           // pp_stages > 1
  std::shared_ptr<GradTiming> timing_ = std::make_shared<GradTiming>();
  Clock::time_point start_;
  int64_t steps_run_ = 0;
  int64_t measured_steps_ = 0;  // steps after the warm-up ones: the summary's samples_per_sec
  double measured_s_ = 0;
  Window window_;
  int64_t allocated_before_model_ = 0;  // CPU tensor bytes held when the model was built
  int64_t activation_bytes_ = -1;       // MemoryUse::activation_bytes
};

Trainer::Trainer(const TrainOptions& o) : o_(o) {
  DataConfig data_config = o.data;
  data_config.seed = o.seed;
  data_ = load_data(data_config);
  pg_ = make_group(o);
  rank_ = pg_->rank();
  world_ = pg_->size();
  set_log_rank(rank_);
  timeout_ = timeout_of(o);
  progress_ =
      std::make_unique<Progress>(parse_progress_mode(o.progress), rank_ == 0, o.metrics_path);
  dp_size_ = world_;
  dp_rank_ = rank_;
  if (o.pp_stages > 1) {
    if (world_ % o.pp_stages != 0) {
      throw InvalidArgument(str("--pp-stages ", o.pp_stages, " does not divide the world size ",
                                world_, " (the world is pp-stages x data-parallel replicas)"));
    }
    mesh_ = std::make_shared<comm::DeviceMesh>(
        pg_, std::vector<comm::DeviceMesh::Dim>{{"pp", o.pp_stages}, {"dp", world_ / o.pp_stages}});
    dp_size_ = mesh_->size("dp");
    dp_rank_ = mesh_->coordinate("dp");
  }

  sampler_ = std::make_unique<DistributedSampler>(data_.train->size(), dp_size_, dp_rank_,
                                                  /*shuffle=*/true, o.seed);
  steps_per_epoch_ = sampler_->steps_left(0, o.batch_size);
  if (steps_per_epoch_ < 1) {
    throw InvalidArgument(str("the training set has ", data_.train->size(), " samples, fewer than ",
                              "one step needs (--batch-size ", o.batch_size, " x ",
                              mesh_ ? "data-parallel replicas " : "world size ", dp_size_, ")"));
  }
  total_steps_ = planned_steps();

  // The model is initialised on the host and then moved: the same seed gives the same initial
  // parameters on every device.
  torch::manual_seed(o.seed);
  reset_peak_cpu_memory();
  allocated_before_model_ = cpu_memory_stats().allocated_bytes;
  model_ = build_train_model(o.model);
  model_->to(o.device);
  if (o.strategy == "ddp" && !mesh_) optimizer_ = make_optimizer(o, model_->parameters());
  fingerprint_ = fingerprint(o, data_.train->size());
  num_params_ = count_parameters(*model_);
  progress_->note(str(
      "tdist-train: ", describe_model(o.model), " (", num_params_, " parameters) on ",
      data_.description, "; world size ", world_, " on ", o.device.str(), ", strategy ", o.strategy,
      mesh_ ? str(" across ", dp_size_, " pipelines of ", o.pp_stages, " stages") : std::string(),
      ", batch ", o.batch_size, mesh_ ? " per pipeline, " : " per rank, ", o.optimizer, " lr ",
      o.lr > 0 ? o.lr : default_lr(o.optimizer), "; ", steps_per_epoch_, " steps per epoch, ",
      total_steps_, " steps"));
  test_hook_ = TestHook::from_env(rank_, world_);
}

void Trainer::resume() {
  std::optional<std::vector<char>> bytes;
  std::string read_error;
  if (rank_ == 0) {
    try {
      bytes = read_checkpoint_file(o_.checkpoint_dir);
    } catch (const std::exception& e) {
      read_error = e.what();
    }
  }
  auto shared = share_checkpoint(*pg_, bytes, read_error, timeout_);
  if (!shared) {
    progress_->note(str("no checkpoint in ", o_.checkpoint_dir, ": starting from step 0"));
    return;
  }
  // Under fsdp and hsdp the model and optimizer are loaded from the sharded checkpoint once
  // start_training() has wrapped the model (Note [Checkpoint protocol] 6).
  // Pipelines: every rank loads its part once start_training() has built the pipeline
  // (Note [Pipelined checkpoints] in pipeline_strategy.h). Under zero1 a whole optimizer is
  // loaded, as ddp's; start_training() hands each rank the state of its partition (Note
  // [ZeRO-1] 5).
  if (o_.strategy == "zero1") optimizer_ = make_optimizer(o_, model_->parameters());
  state_ = o_.sharded() || mesh_
               ? load_training_state(*shared, fingerprint_)
               : load_checkpoint(*shared, *model_, *optimizer_, fingerprint_, o_.device);
  const int64_t n = data_.train->size();
  if (state_.step < 0 || state_.epoch < 0 || state_.epoch_position < 0 ||
      state_.epoch_position > n) {
    TDIST_THROW(Error, "the checkpoint's position (step ", state_.step, ", epoch ", state_.epoch,
                ", sample ", state_.epoch_position, ") lies outside the training set of ", n,
                " samples");
  }
  if (state_.rng_state.defined()) set_rng_state(state_.rng_state);
  resumed_from_ = state_.step;
  saved_step_ = state_.step;
  progress_->note(str("resumed from ", checkpoint_path(o_.checkpoint_dir), " at step ", state_.step,
                      " (epoch ", state_.epoch, ", sample ", state_.epoch_position, " of ", n,
                      ")"));
  if (state_.world_size != world_) {
    progress_->note(str("the checkpoint was written at world size ", state_.world_size,
                        "; continuing at world size ", world_, ": a step now takes ",
                        o_.batch_size * dp_size_, " samples (", o_.batch_size, " per ",
                        mesh_ ? "pipeline" : "rank", ") instead of ",
                        o_.batch_size * state_.world_size / o_.pp_stages));
  }
  roll_over_epoch();
  total_steps_ = planned_steps();
}

void Trainer::roll_over_epoch() {
  if (sampler_->steps_left(state_.epoch_position, o_.batch_size) > 0) return;
  state_.epoch += 1;
  state_.epoch_position = 0;
}

int64_t Trainer::planned_steps() const {
  if (o_.steps > 0) return o_.steps;
  if (state_.epoch >= o_.epochs) return state_.step;
  return state_.step + sampler_->steps_left(state_.epoch_position, o_.batch_size) +
         (o_.epochs - state_.epoch - 1) * steps_per_epoch_;
}

void Trainer::start_training() {
  if (mesh_) {
    PipelineConfig pc;
    pc.stages = o_.pp_stages;
    pc.schedule = o_.schedule;
    pc.microbatches = o_.microbatches;
    pc.timeout = timeout_;
    pc.shard = o_.sharded();
    pc.shard_size = o_.shard_size;  // 0 (every replica) unless hsdp
    pc.bf16 = o_.mixed_precision == "bf16";
    pipeline_ = std::make_unique<PipelineStrategy>(
        model_, is_language_model(o_.model), mesh_, pc,
        [](const at::Tensor& logits, const at::Tensor& labels) { return loss_of(logits, labels); },
        o_.ddp);
    optimizer_ = make_optimizer(o_, pipeline_->parameters());
    if (rank_ == 0) progress_->note("pipeline: " + pipeline_->describe());
    if (!state_.sharded_subdir.empty()) {  // resumed (Note [Pipelined checkpoints])
      if (state_.world_size != world_ && pipeline_->sharded()) {
        throw InvalidArgument(str("the checkpoint was written at world size ", state_.world_size,
                                  "; a pipelined run resumes at the world size it was written "
                                  "at (",
                                  world_, " now), one part per rank, under --strategy ",
                                  o_.strategy, " (under ddp at any world size)"));
      }
      // Under DDP a stage's replicas wrote equal parts: at another world size (another number
      // of replicas; the fingerprint holds the stages) each rank reads its stage's first one.
      const int old_dp = state_.world_size / o_.pp_stages;
      const int from = state_.world_size == world_ ? rank_ : mesh_->coordinate("pp") * old_dp;
      const std::string dir = o_.checkpoint_dir + "/" + state_.sharded_subdir;
      pipeline_->load_part(dir, from, *optimizer_, part_fingerprint(from, old_dp));
      progress_->note(
          str("loaded every rank's part of the pipeline from ", dir,
              state_.world_size == world_
                  ? std::string()
                  : str(" (written by ", old_dp, " replicas of each stage; ", dp_size_, " now)")));
    }
  } else if (o_.sharded()) {
    fsdp::FSDPOptions fopts;
    fopts.reshard_after_forward = o_.reshard_after_forward;
    fopts.shard_size = o_.shard_size;  // 0 (the whole group) unless hsdp
    if (o_.mixed_precision == "bf16") fopts.param_dtype = at::kBFloat16;
    fopts.timeout = timeout_;
    sharded_ =
        std::make_unique<ShardedModel>(fsdp::fully_shard(model_, model_->units(), pg_, fopts));
    optimizer_ = make_optimizer(o_, sharded_->parameters());
    if (!state_.sharded_subdir.empty()) {  // resumed (Note [Checkpoint protocol] 6)
      const std::string dir = o_.checkpoint_dir + "/" + state_.sharded_subdir;
      check_sharded_index(dir, state_);  // Note [Checkpoint key]
      fsdp::load_sharded_checkpoint(dir, *sharded_, optimizer_.get());
      progress_->note(str("loaded the sharded model and optimizer from ", dir));
    }
    // No gradient watch: the sharded gradients are written at the end of backward, not by
    // autograd, so comm_wait_ms stays 0 under fsdp.
  } else {
    ddp::DDPOptions dopts = o_.ddp;
    dopts.timeout = timeout_;
    ddp_model_ = std::make_unique<Model>(model_, pg_, dopts);
    if (auto hook = make_hook(o_)) ddp_model_->register_comm_hook(std::move(hook));
    watch_gradients(model_->parameters(), timing_);
    if (o_.strategy == "zero1") {
      fsdp::ZeroRedundancyOptimizerOptions zopts;
      zopts.timeout = timeout_;
      zero_ = std::make_unique<fsdp::ZeroRedundancyOptimizer>(
          model_->parameters(),
          [this](std::vector<at::Tensor> params) { return make_optimizer(o_, params); }, pg_,
          zopts);
      if (optimizer_) {  // resumed: this rank's part of the whole optimizer loaded
        zero_->load_state_dict(*optimizer_);
        optimizer_.reset();
      }
    }
  }
  start_ = Clock::now();
}

at::Tensor Trainer::forward(const at::Tensor& inputs) {
  return sharded_ ? (*sharded_)(inputs) : (*ddp_model_)(inputs);
}

void Trainer::zero_grad() {
  if (zero_) {
    zero_->zero_grad();
  } else {
    optimizer_->zero_grad();
  }
}

void Trainer::optimizer_step() {
  if (zero_) {
    zero_->step();
  } else {
    optimizer_->step();
  }
}

MemoryUse Trainer::measure_memory() const {
  MemoryUse m;
  std::vector<at::Tensor> params = model_->parameters();
  if (pipeline_) {
    // The model's parameters (other stages' empty while training; a sharded stage's empty
    // between steps) and, sharded, the shards the optimizer steps.
    std::vector<at::Tensor> optimized = pipeline_->parameters();
    if (!pipeline_->sharded()) optimized.clear();
    m.parameter_bytes = storage_bytes(params) + storage_bytes(optimized);
    m.gradient_bytes = storage_bytes(grads_of(params)) + storage_bytes(grads_of(optimized));
  } else if (sharded_) {
    // The shards, and the module's own parameters (empty between steps) with their gradients
    // (freed after each reduce-scatter), plus anything still gathered.
    std::vector<at::Tensor> shards = sharded_->parameters();
    m.parameter_bytes = storage_bytes(shards) + storage_bytes(params) +
                        static_cast<int64_t>(sharded_->unsharded_bytes());
    m.gradient_bytes = storage_bytes(grads_of(shards)) + storage_bytes(grads_of(params));
  } else {
    m.parameter_bytes = storage_bytes(params);
    m.gradient_bytes = storage_bytes(grads_of(params));
  }
  m.optimizer_state_bytes = static_cast<int64_t>(zero_ ? zero_->local_state_bytes()
                                                       : fsdp::optimizer_state_bytes(*optimizer_));
  m.peak_rss_bytes = peak_rss_bytes();
  if (!o_.device.is_cuda())
    m.peak_allocated_bytes = cpu_memory_stats().peak_bytes - allocated_before_model_;
  m.activation_bytes = activation_bytes_;
  return m;
}

std::vector<MemoryUse> Trainer::memory_per_rank(const MemoryUse& mine) const {
  at::Tensor all = at::zeros({world_, 6}, at::kDouble);
  all[rank_].copy_(at::tensor(
      {static_cast<double>(mine.parameter_bytes), static_cast<double>(mine.gradient_bytes),
       static_cast<double>(mine.optimizer_state_bytes), static_cast<double>(mine.peak_rss_bytes),
       static_cast<double>(mine.peak_allocated_bytes), static_cast<double>(mine.activation_bytes)},
      at::kDouble));
  comm::AllreduceOptions aopts;
  aopts.timeout = timeout_;
  pg_->allreduce(all, aopts)->wait();
  std::vector<MemoryUse> out(static_cast<size_t>(world_));
  for (int r = 0; r < world_; ++r) {
    auto row = all[r];
    out[r] = MemoryUse{
        static_cast<int64_t>(row[0].item<double>()), static_cast<int64_t>(row[1].item<double>()),
        static_cast<int64_t>(row[2].item<double>()), static_cast<int64_t>(row[3].item<double>()),
        static_cast<int64_t>(row[4].item<double>()), static_cast<int64_t>(row[5].item<double>())};
  }
  return out;
}

void Trainer::train_epoch() {
  const int64_t epoch = state_.epoch;
  const std::vector<int64_t> order = sampler_->epoch_order(epoch);
  while (state_.epoch == epoch && state_.step < total_steps_) {
    test_hook_.after_step(state_.step);
    train_step(order);
    if (state_.step % o_.log_every == 0 || state_.step == total_steps_) report_window(epoch);
    if (o_.eval_every > 0 && state_.step % o_.eval_every == 0 && state_.step != total_steps_) {
      evaluate_now();
    }
    if (!o_.checkpoint_dir.empty() && o_.checkpoint_every > 0 &&
        state_.step % o_.checkpoint_every == 0) {
      save();
    }
  }
}

// One optimizer step on this rank's batch at the sampler position (in `epoch_order`), timed part
// by part into the window of the next log point.
void Trainer::train_step(const std::vector<int64_t>& epoch_order) {
  const auto t0 = Clock::now();
  Batch batch =
      data_.train->get(sampler_->step_indices(epoch_order, state_.epoch_position, o_.batch_size));
  batch.images = batch.images.to(o_.device);
  batch.labels = batch.labels.to(o_.device);
  const auto t1 = Clock::now();
  Clock::time_point t4;
  zero_grad();
  Window& w = window_;
  if (pipeline_) {
    // The schedule interleaves forwards and backwards: their compute time from the pipeline's
    // timeline, and its idle time (waiting for neighbours, DDP's reduction) as comm_wait_ms.
    const PipelineStepResult r = pipeline_->step(batch.images, batch.labels);
    const auto t2 = Clock::now();
    optimizer_step();
    const auto t3 = Clock::now();
    w.loss_sum += r.loss;  // 0 on the ranks without the last stage
    w.correct += r.correct;
    w.predictions += r.predictions;
    w.forward_ms += r.compute_forward_ms;
    w.backward_ms += r.compute_backward_ms;
    w.comm_wait_ms += r.idle_ms;
    w.optimizer_ms += 1e3 * seconds_between(t2, t3);
    t4 = t3;
  } else {
    const int64_t before_forward = cpu_memory_stats().allocated_bytes;
    at::Tensor logits = forward(batch.images);
    at::Tensor loss = loss_of(logits, batch.labels);
    // Counted now so that the logits (which the loss did not save) are freed before backward.
    w.correct += logits.argmax(-1).eq(batch.labels).sum().item<int64_t>();
    logits = at::Tensor();
    if (!o_.device.is_cuda()) {
      activation_bytes_ =
          std::max(activation_bytes_, cpu_memory_stats().allocated_bytes - before_forward);
    }
    const auto t2 = Clock::now();
    const int64_t backward_begin = now_us();
    loss.backward();
    const int64_t backward_end = now_us();
    const auto t3 = Clock::now();
    optimizer_step();
    t4 = Clock::now();
    const int64_t last_grad = timing_->last_grad_us.load(std::memory_order_relaxed);
    w.loss_sum += loss.item<double>();
    w.predictions += batch.labels.numel();
    w.forward_ms += 1e3 * seconds_between(t1, t2);
    w.backward_ms += 1e3 * seconds_between(t2, t3);
    w.comm_wait_ms += last_grad >= backward_begin ? (backward_end - last_grad) / 1e3 : 0.0;
    w.optimizer_ms += 1e3 * seconds_between(t3, t4);
  }
  w.steps += 1;
  w.samples += o_.batch_size;
  w.step_s += seconds_between(t0, t4);
  w.data_ms += 1e3 * seconds_between(t0, t1);
  ++steps_run_;
  if (steps_run_ > o_.warmup_steps) {
    measured_s_ += seconds_between(t0, t4);
    ++measured_steps_;
  }
  state_.step += 1;
  state_.epoch_position += o_.batch_size * dp_size_;
  roll_over_epoch();
}

// Collective: every rank reports at the same steps; the window's sums are averaged over ranks.
void Trainer::report_window(int64_t epoch) {
  const Window& w = window_;
  at::Tensor sums =
      at::tensor({w.loss_sum, static_cast<double>(w.correct), static_cast<double>(w.predictions)},
                 at::kDouble);
  comm::AllreduceOptions aopts;
  aopts.timeout = timeout_;
  pg_->allreduce(sums, aopts)->wait();
  StepReport r;
  r.step = state_.step;
  r.total_steps = total_steps_;
  r.epoch = epoch;
  r.window_steps = w.steps;
  // Each replica's loss once: on every rank, or (pipelines) on its last stage's rank only.
  r.loss = sums[0].item<double>() / static_cast<double>(w.steps * dp_size_);
  r.train_accuracy = sums[1].item<double>() / sums[2].item<double>();
  r.samples_per_sec = w.step_s > 0 ? static_cast<double>(w.samples * dp_size_) / w.step_s : 0.0;
  const double n = static_cast<double>(w.steps);
  r.data_ms = w.data_ms / n;
  r.forward_ms = w.forward_ms / n;
  r.backward_ms = w.backward_ms / n;
  r.comm_wait_ms = w.comm_wait_ms / n;
  r.optimizer_ms = w.optimizer_ms / n;
  r.elapsed_s = seconds_between(start_, Clock::now());
  const double per_step =
      measured_steps_ > 0 ? measured_s_ / static_cast<double>(measured_steps_) : w.step_s / n;
  r.eta_s = per_step * static_cast<double>(total_steps_ - state_.step);
  progress_->report(r);
  state_.last_loss = r.loss;
  state_.last_train_accuracy = r.train_accuracy;
  window_ = Window{};
}

EvalResult Trainer::evaluate_now() {
  EvalShare share;
  share.part = rank_;
  share.parts = world_;
  share.batch_size = o_.eval_batch_size;
  share.lockstep = sharded_ != nullptr;
  std::function<at::Tensor(const at::Tensor&)> forward;
  if (pipeline_) {
    // Through the pipeline, batches of the replica's training batch: each replica evaluates
    // its share, each rank its stage.
    share.part = dp_rank_;
    share.parts = dp_size_;
    share.batch_size = o_.batch_size;
    share.fixed_batches = true;
    forward = [this](const at::Tensor& x) { return pipeline_->eval(x); };
  } else {
    // Outside DDP's forward (evaluation needs none of its work); through the sharded model's
    // (a collective) under fsdp.
    forward = [this](const at::Tensor& x) {
      return sharded_ ? (*sharded_)(x) : model_->forward(x);
    };
  }
  EvalResult e = evaluate(forward, *model_, *data_.test, *pg_, share, timeout_, o_.device,
                          is_language_model(o_.model));
  progress_->evaluation(state_.step, e.accuracy, e.samples, e.loss);
  return e;
}

void Trainer::save() {
  state_.rng_state = rng_state();
  state_.world_size = world_;
  if (sharded_ || pipeline_) {
    // Note [Checkpoint protocol] 6 (Note [Pipelined checkpoints]): every rank's shards (or
    // part), then rank 0's checkpoint.pt naming them, in a directory only we can write (Note
    // [Checkpoint key]).
    check_private_directory(o_.checkpoint_dir, /*create=*/true);
    const std::string prefix = pipeline_ ? "pipeline-" : "sharded-";
    state_.sharded_subdir = prefix + std::to_string(state_.step);
    const std::string dir = o_.checkpoint_dir + "/" + state_.sharded_subdir;
    if (pipeline_) {
      save_pipeline_parts(dir);
    } else {
      fsdp::save_sharded_checkpoint(dir, *sharded_, optimizer_.get());
    }
    if (rank_ == 0) {
      state_.sharded_index_sha256 = pipeline_ ? std::string() : sharded_index_digest(dir);
      save_training_state(o_.checkpoint_dir, state_, fingerprint_);
      std::error_code ec;
      for (const auto& e : std::filesystem::directory_iterator(o_.checkpoint_dir, ec)) {
        const std::string name = e.path().filename().string();
        if (name.rfind(prefix, 0) == 0 && name != state_.sharded_subdir) {
          std::filesystem::remove_all(e.path(), ec);  // an older checkpoint's: best effort
        }
      }
    }
  } else if (zero_) {
    // Note [ZeRO-1] 5: rank 0 gathers the whole optimizer and writes it as ddp's checkpoint.
    std::unique_ptr<torch::optim::Optimizer> whole;
    if (rank_ == 0) whole = make_optimizer(o_, model_->parameters());
    zero_->consolidate_state_dict(whole.get(), 0);
    if (rank_ == 0) save_checkpoint(o_.checkpoint_dir, *model_, *whole, state_, fingerprint_);
  } else if (rank_ == 0) {
    save_checkpoint(o_.checkpoint_dir, *model_, *optimizer_, state_, fingerprint_);
  }
  saved_step_ = state_.step;
}

std::string Trainer::part_fingerprint(int rank, int dp_size) const {
  return str(fingerprint_, " part=rank ", rank, " of pp ", o_.pp_stages, " x dp ", dp_size);
}

void Trainer::save_pipeline_parts(const std::string& dir) {
  std::string error;
  try {
    pipeline_->save_part(dir, rank_, *optimizer_, state_, part_fingerprint(rank_, dp_size_));
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Every rank learns whether every part was written before rank 0 names them.
  at::Tensor failed = at::zeros({world_}, at::kInt);
  if (!error.empty()) failed[rank_] = 1;
  comm::AllreduceOptions aopts;
  aopts.timeout = timeout_;
  pg_->allreduce(failed, aopts)->wait();
  std::string ranks;
  for (int r = 0; r < world_; ++r) {
    if (failed[r].item<int>() != 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  }
  if (!ranks.empty()) {
    TDIST_THROW(Error, "the pipelined checkpoint of step ", state_.step, " in ", dir,
                " was not written: rank(s) ", ranks, " failed",
                error.empty() ? std::string() : "; here: " + error);
  }
}

void Trainer::finish() {
  const double train_s = seconds_between(start_, Clock::now());
  if (!o_.checkpoint_dir.empty() && saved_step_ != state_.step) save();
  const std::vector<MemoryUse> memory = memory_per_rank(measure_memory());
  const EvalResult final_eval = evaluate_now();
  std::string mem_line =
      "memory per rank (parameters + gradients + optimizer state; peak RSS; peak of tensors):";
  for (int r = 0; r < world_; ++r) {
    const MemoryUse& m = memory[static_cast<size_t>(r)];
    mem_line += str(
        r ? "," : "", " rank ", r, " ", format_mb(m.parameter_bytes), " + ",
        format_mb(m.gradient_bytes), " + ", format_mb(m.optimizer_state_bytes), " = ",
        format_mb(m.parameter_bytes + m.gradient_bytes + m.optimizer_state_bytes), " MB; ",
        format_mb(m.peak_rss_bytes), " MB; ",
        m.peak_allocated_bytes >= 0 ? format_mb(m.peak_allocated_bytes) + " MB" : std::string("-"));
  }
  progress_->note(mem_line);
  progress_->finish();
  std::vector<at::Tensor> values;
  // Pipelines: every rank gathers the whole model to hash it (each trained only its stage).
  if (pipeline_) pipeline_->sync_full_model();
  if (sharded_) {
    for (auto& [name, t] : sharded_->full_parameters()) values.push_back(t);  // a collective
  } else {
    values = model_->parameters();
  }
  const uint64_t hash = params_hash(values);
  if (rank_ == 0 && !o_.summary_path.empty()) write_summary(final_eval, train_s, hash, memory);
  std::printf("rank %d of %d: trained %lld steps, test accuracy %.2f%%, parameters fnv1a64 %s\n",
              rank_, world_, static_cast<long long>(state_.step), 100.0 * final_eval.accuracy,
              hex64(hash).c_str());
  std::fflush(stdout);
  comm::BarrierOptions bopts;
  bopts.timeout = timeout_;
  pg_->barrier(bopts)->wait();
}

void Trainer::write_summary(const EvalResult& final_eval, double train_s, uint64_t hash,
                            const std::vector<MemoryUse>& memory) const {
  const double samples_per_sec =
      measured_steps_ > 0
          ? static_cast<double>(measured_steps_ * o_.batch_size * dp_size_) / measured_s_
          : std::nan("");
  nlohmann::json s = {
      {"world_size", world_},
      {"device", o_.device.str()},
      {"params", num_params_},
      {"model", describe_model(o_.model)},
      {"dataset", data_.description},
      {"optimizer", o_.optimizer},
      {"lr", o_.lr > 0 ? o_.lr : default_lr(o_.optimizer)},
      {"batch_size", o_.batch_size},
      {"seed", o_.seed},
      {"steps", state_.step},
      {"steps_run", steps_run_},
      {"steps_per_epoch", steps_per_epoch_},
      {"resumed_from_step",
       resumed_from_ >= 0 ? nlohmann::json(resumed_from_) : nlohmann::json(nullptr)},
      {"warmup_steps", o_.warmup_steps},
      {"samples_per_sec", number_or_null(samples_per_sec)},
      {"final_loss", number_or_null(state_.last_loss >= 0 ? state_.last_loss : std::nan(""))},
      {"train_accuracy",
       number_or_null(state_.last_train_accuracy >= 0 ? state_.last_train_accuracy : std::nan(""))},
      {"accuracy", number_or_null(final_eval.accuracy)},
      {"eval_samples", final_eval.samples},
      {"train_seconds", train_s},
      {"params_fnv1a64", hex64(hash)},
      {"strategy", o_.strategy},
  };
  if (o_.sharded()) {
    s["reshard_after_forward"] = o_.reshard_after_forward;
    s["mixed_precision"] = o_.mixed_precision;
  }
  if (o_.strategy == "hsdp") s["shard_size"] = o_.shard_size;
  if (pipeline_) {
    s["pp_stages"] = o_.pp_stages;
    s["schedule"] = o_.schedule;
    s["microbatches"] = o_.microbatches;
  }
  if (is_language_model(o_.model)) {
    s["eval_loss"] = number_or_null(final_eval.loss);
    s["perplexity"] = number_or_null(std::exp(final_eval.loss));
  }
  nlohmann::json mem = nlohmann::json::array();
  for (const MemoryUse& m : memory) {
    mem.push_back({{"parameter_bytes", m.parameter_bytes},
                   {"gradient_bytes", m.gradient_bytes},
                   {"optimizer_state_bytes", m.optimizer_state_bytes},
                   {"peak_rss_bytes", m.peak_rss_bytes},
                   {"peak_allocated_bytes", m.peak_allocated_bytes >= 0
                                                ? nlohmann::json(m.peak_allocated_bytes)
                                                : nlohmann::json(nullptr)},
                   {"activation_bytes", m.activation_bytes >= 0 ? nlohmann::json(m.activation_bytes)
                                                                : nlohmann::json(nullptr)}});
  }
  s["memory_per_rank"] = mem;
  // core/atomic_file.h: a fresh 0600 temporary file (never one planted at its name), renamed.
  const std::string summary = s.dump(2) + "\n";
  tdist::write_file_atomically(o_.summary_path, {summary});
}

}  // namespace

void run_training(const TrainOptions& o) {
  validate(o);
  if (o.threads > 0) at::set_num_threads(o.threads);
  track_cpu_memory();  // the summary's peak_allocated_bytes
  Trainer trainer(o);
  if (o.resume) trainer.resume();
  trainer.start_training();
  while (!trainer.done()) trainer.train_epoch();
  trainer.finish();
}

}  // namespace tdist::train
