#include "apps/train/trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "apps/train/checkpoint.h"
#include "apps/train/progress.h"
#include "tdist/core/hash.h"
#include "tdist/comm/process_group.h"
#include "tdist/core/env.h"
#include "tdist/core/hash_store.h"
#include "tdist/core/logging.h"
#include "tdist/ddp/distributed_data_parallel.h"

namespace tdist::train {
namespace {

using Clock = std::chrono::steady_clock;
using Model = ddp::DistributedDataParallel<torch::nn::Sequential>;

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
  const bool launched = env::get("RANK") || (env::get("SLURM_PROCID") && env::get("SLURM_NTASKS")) ||
                        env::get("OMPI_COMM_WORLD_RANK");
  if (!launched) return comm::create_process_group(std::make_shared<HashStore>(), 0, 1, popts);
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

void watch_gradients(const std::vector<at::Tensor>& params, const std::shared_ptr<GradTiming>& timing) {
  for (at::Tensor p : params) {
    p.register_hook([t = timing](const at::Tensor&) {
      t->last_grad_us.store(now_us(), std::memory_order_relaxed);
    });
  }
}

// Everything that must match for a resumed run to continue exactly (Note [Checkpoint protocol] 4).
std::string fingerprint(const TrainOptions& o, int world, int64_t train_size) {
  return str("model=", describe_model(o.model), " optimizer=", o.optimizer,
             " lr=", o.lr > 0 ? o.lr : default_lr(o.optimizer), " momentum=", o.momentum,
             " weight_decay=", o.weight_decay, " batch_size=", o.batch_size, " world_size=", world,
             " seed=", o.seed, " dataset=", o.data.dataset, " train_samples=", train_size,
             o.data.dataset == "synthetic" ? str(" signal=", o.data.signal) : std::string(),
             " comm_hook=", o.comm_hook);
}

// FNV-1a over the bytes of every parameter, in order: equal iff the parameters are bit-equal
// (up to hash collisions).
uint64_t params_hash(const std::vector<at::Tensor>& params) {
  uint64_t h = kFnv1aOffset;
  for (const auto& p : params) {
    at::Tensor c = p.detach().contiguous();
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
  double accuracy = std::nan("");
  int64_t samples = 0;
};

// Collective: each rank classifies the test samples r, r + world, ...; the counts are summed.
EvalResult evaluate(torch::nn::Sequential& model, const Dataset& test, comm::ProcessGroup& pg,
                    int64_t batch_size, std::chrono::milliseconds timeout) {
  torch::NoGradGuard no_grad;
  model->eval();
  int64_t correct = 0, total = 0;
  std::vector<int64_t> idx;
  auto flush = [&] {
    if (idx.empty()) return;
    Batch b = test.get(idx);
    correct += model->forward(b.images).argmax(1).eq(b.labels).sum().item<int64_t>();
    total += static_cast<int64_t>(idx.size());
    idx.clear();
  };
  for (int64_t i = pg.rank(); i < test.size(); i += pg.size()) {
    idx.push_back(i);
    if (static_cast<int64_t>(idx.size()) == batch_size) flush();
  }
  flush();
  model->train();
  at::Tensor counts = at::tensor({static_cast<double>(correct), static_cast<double>(total)}, at::kDouble);
  comm::AllreduceOptions opts;
  opts.timeout = timeout;
  pg.allreduce(counts, opts)->wait();
  EvalResult r;
  r.samples = static_cast<int64_t>(counts[1].item<double>());
  if (r.samples > 0) r.accuracy = counts[0].item<double>() / static_cast<double>(r.samples);
  return r;
}

// Sums over the steps since the last report.
struct Window {
  int64_t steps = 0;
  double loss_sum = 0;
  int64_t correct = 0;
  int64_t samples = 0;
  double step_s = 0;
  double data_ms = 0, forward_ms = 0, backward_ms = 0, comm_wait_ms = 0, optimizer_ms = 0;
};

// Test hook (docs/train.md): TDIST_TRAIN_FAIL_AT_STEP=K kills rank TDIST_TRAIN_FAIL_RANK
// (default: the last rank) with SIGKILL once K steps are done, on the first attempt only
// (TDIST_RESTART_COUNT unset or 0), to test restarts and resume.
struct FailureInjection {
  int64_t at_step = -1;
  bool armed = false;

  static FailureInjection from_env(int rank, int world) {
    FailureInjection f;
    f.at_step = env::get_int("TDIST_TRAIN_FAIL_AT_STEP", -1, -1, INT64_MAX);
    const int64_t fail_rank = env::get_int("TDIST_TRAIN_FAIL_RANK", world - 1, 0, world - 1);
    f.armed = f.at_step >= 0 && fail_rank == rank &&
              env::get_int("TDIST_RESTART_COUNT", 0, 0, INT64_MAX) == 0;
    return f;
  }
  void check(int64_t steps_done) const {
    if (!armed || steps_done != at_step) return;
    std::fprintf(stderr, "tdist-train: TDIST_TRAIN_FAIL_AT_STEP=%lld: killing this worker\n",
                 static_cast<long long>(at_step));
    std::fflush(stderr);
    ::raise(SIGKILL);
  }
};

void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) TDIST_THROW(Error, "cannot write '", tmp, "'");
    out << text;
    out.flush();
    if (!out) TDIST_THROW(Error, "cannot write '", tmp, "'");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    TDIST_THROW(Error, "cannot rename '", tmp, "' to '", path, "'");
  }
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
  parse_progress_mode(o.progress);
  describe_model(o.model);  // checks the model's settings
}

void run_training(const TrainOptions& o) {
  validate(o);
  if (o.threads > 0) at::set_num_threads(o.threads);
  // Data first: a bad directory or file fails at once on every rank, before any rendezvous.
  DataConfig data_config = o.data;
  data_config.seed = o.seed;
  DataSplits data = load_data(data_config);
  auto pg = make_group(o);
  const int rank = pg->rank();
  const int world = pg->size();
  set_log_rank(rank);
  const auto timeout = timeout_of(o);
  Progress progress(parse_progress_mode(o.progress), rank == 0, o.metrics_path);

  DistributedSampler sampler(data.train->size(), world, rank, /*shuffle=*/true, o.seed);
  const int64_t steps_per_epoch = sampler.num_samples() / o.batch_size;
  if (steps_per_epoch < 1) {
    throw InvalidArgument(str("the training set has ", data.train->size(), " samples, fewer than ",
                              "one step needs (--batch-size ", o.batch_size, " x world size ", world,
                              ")"));
  }
  const int64_t total_steps = o.steps > 0 ? o.steps : o.epochs * steps_per_epoch;

  torch::manual_seed(o.seed);
  torch::nn::Sequential model = build_model(o.model);
  auto optimizer = make_optimizer(o, model->parameters());
  const std::string print = fingerprint(o, world, data.train->size());
  const int64_t num_params = count_parameters(*model);
  progress.note(str("tdist-train: ", describe_model(o.model), " (", num_params, " parameters) on ",
                    data.description, "; world size ", world, ", batch ", o.batch_size,
                    " per rank, ", o.optimizer, " lr ", o.lr > 0 ? o.lr : default_lr(o.optimizer),
                    "; ", steps_per_epoch, " steps per epoch, ", total_steps, " steps"));

  TrainState state;
  int64_t resumed_from = -1;
  if (o.resume) {
    std::optional<std::vector<char>> bytes;
    std::string read_error;
    if (rank == 0) {
      try {
        bytes = read_checkpoint_file(o.checkpoint_dir);
      } catch (const std::exception& e) {
        read_error = e.what();
      }
    }
    auto shared = share_checkpoint(*pg, bytes, read_error, timeout);
    if (shared) {
      state = load_checkpoint(*shared, *model, *optimizer, print);
      TDIST_CHECK_EQ(state.epoch * steps_per_epoch + state.batch_in_epoch, state.step,
                     "the checkpoint's sampler position (epoch ", state.epoch, ", batch ",
                     state.batch_in_epoch, ") does not match its step");
      if (state.rng_state.defined()) set_rng_state(state.rng_state);
      resumed_from = state.step;
      progress.note(str("resumed from ", checkpoint_path(o.checkpoint_dir), " at step ", state.step,
                        " (epoch ", state.epoch, ", batch ", state.batch_in_epoch, ")"));
    } else {
      progress.note(str("no checkpoint in ", o.checkpoint_dir, ": starting from step 0"));
    }
  }

  ddp::DDPOptions dopts = o.ddp;
  dopts.timeout = timeout;
  Model ddp_model(model, pg, dopts);
  if (auto hook = make_hook(o)) ddp_model.register_comm_hook(std::move(hook));
  auto timing = std::make_shared<GradTiming>();
  watch_gradients(model->parameters(), timing);

  const FailureInjection failure = FailureInjection::from_env(rank, world);
  auto save = [&] {
    state.rng_state = rng_state();
    if (rank == 0) save_checkpoint(o.checkpoint_dir, *model, *optimizer, state, print);
  };
  int64_t saved_step = resumed_from;

  const auto start = Clock::now();
  int64_t steps_run = 0;
  int64_t measured_steps = 0;
  double measured_s = 0;
  Window w;
  int64_t cached_epoch = -1;
  std::vector<int64_t> epoch_indices;
  for (int64_t step = state.step; step < total_steps; ++step) {
    failure.check(step);
    const int64_t epoch = step / steps_per_epoch;
    const int64_t in_epoch = step % steps_per_epoch;
    const auto t0 = Clock::now();
    if (epoch != cached_epoch) {
      epoch_indices = sampler.epoch_indices(epoch);
      cached_epoch = epoch;
    }
    const auto first = epoch_indices.begin() + in_epoch * o.batch_size;
    Batch batch = data.train->get(std::vector<int64_t>(first, first + o.batch_size));
    const auto t1 = Clock::now();
    optimizer->zero_grad();
    at::Tensor logits = ddp_model(batch.images);
    at::Tensor loss = torch::nn::functional::cross_entropy(logits, batch.labels);
    const auto t2 = Clock::now();
    const int64_t backward_begin = now_us();
    loss.backward();
    const int64_t backward_end = now_us();
    const auto t3 = Clock::now();
    optimizer->step();
    const auto t4 = Clock::now();

    const int64_t last_grad = timing->last_grad_us.load(std::memory_order_relaxed);
    w.steps += 1;
    w.loss_sum += loss.item<double>();
    w.correct += logits.argmax(1).eq(batch.labels).sum().item<int64_t>();
    w.samples += o.batch_size;
    w.step_s += seconds_between(t0, t4);
    w.data_ms += 1e3 * seconds_between(t0, t1);
    w.forward_ms += 1e3 * seconds_between(t1, t2);
    w.backward_ms += 1e3 * seconds_between(t2, t3);
    w.comm_wait_ms += last_grad >= backward_begin ? (backward_end - last_grad) / 1e3 : 0.0;
    w.optimizer_ms += 1e3 * seconds_between(t3, t4);
    ++steps_run;
    if (steps_run > o.warmup_steps) {
      measured_s += seconds_between(t0, t4);
      ++measured_steps;
    }
    state.step = step + 1;
    state.epoch = state.step / steps_per_epoch;
    state.batch_in_epoch = state.step % steps_per_epoch;

    if (state.step % o.log_every == 0 || state.step == total_steps) {
      // Collective: every rank reports at the same steps.
      at::Tensor sums = at::tensor({w.loss_sum, static_cast<double>(w.correct),
                                    static_cast<double>(w.samples)}, at::kDouble);
      comm::AllreduceOptions aopts;
      aopts.timeout = timeout;
      pg->allreduce(sums, aopts)->wait();
      StepReport r;
      r.step = state.step;
      r.total_steps = total_steps;
      r.epoch = epoch;
      r.window_steps = w.steps;
      r.loss = sums[0].item<double>() / static_cast<double>(w.steps * world);
      r.train_accuracy = sums[1].item<double>() / sums[2].item<double>();
      r.samples_per_sec = w.step_s > 0 ? static_cast<double>(w.samples * world) / w.step_s : 0.0;
      const double n = static_cast<double>(w.steps);
      r.data_ms = w.data_ms / n;
      r.forward_ms = w.forward_ms / n;
      r.backward_ms = w.backward_ms / n;
      r.comm_wait_ms = w.comm_wait_ms / n;
      r.optimizer_ms = w.optimizer_ms / n;
      r.elapsed_s = seconds_between(start, Clock::now());
      const double per_step = measured_steps > 0 ? measured_s / static_cast<double>(measured_steps)
                                                 : w.step_s / n;
      r.eta_s = per_step * static_cast<double>(total_steps - state.step);
      progress.report(r);
      state.last_loss = r.loss;
      state.last_train_accuracy = r.train_accuracy;
      w = Window{};
    }
    if (o.eval_every > 0 && state.step % o.eval_every == 0 && state.step != total_steps) {
      EvalResult e = evaluate(model, *data.test, *pg, o.eval_batch_size, timeout);
      progress.evaluation(state.step, e.accuracy, e.samples);
    }
    if (!o.checkpoint_dir.empty() && o.checkpoint_every > 0 && state.step % o.checkpoint_every == 0) {
      save();
      saved_step = state.step;
    }
  }
  const double train_s = seconds_between(start, Clock::now());
  if (!o.checkpoint_dir.empty() && saved_step != state.step) save();

  EvalResult final_eval = evaluate(model, *data.test, *pg, o.eval_batch_size, timeout);
  progress.evaluation(state.step, final_eval.accuracy, final_eval.samples);
  progress.finish();
  const uint64_t hash = params_hash(model->parameters());
  const double samples_per_sec =
      measured_steps > 0 ? static_cast<double>(measured_steps * o.batch_size * world) / measured_s
                         : std::nan("");

  if (rank == 0 && !o.summary_path.empty()) {
    nlohmann::json s = {
        {"world_size", world},
        {"params", num_params},
        {"model", describe_model(o.model)},
        {"dataset", data.description},
        {"optimizer", o.optimizer},
        {"lr", o.lr > 0 ? o.lr : default_lr(o.optimizer)},
        {"batch_size", o.batch_size},
        {"seed", o.seed},
        {"steps", state.step},
        {"steps_run", steps_run},
        {"steps_per_epoch", steps_per_epoch},
        {"resumed_from_step", resumed_from >= 0 ? nlohmann::json(resumed_from) : nlohmann::json(nullptr)},
        {"warmup_steps", o.warmup_steps},
        {"samples_per_sec", number_or_null(samples_per_sec)},
        {"final_loss", number_or_null(state.last_loss >= 0 ? state.last_loss : std::nan(""))},
        {"train_accuracy",
         number_or_null(state.last_train_accuracy >= 0 ? state.last_train_accuracy : std::nan(""))},
        {"accuracy", number_or_null(final_eval.accuracy)},
        {"eval_samples", final_eval.samples},
        {"train_seconds", train_s},
        {"params_fnv1a64", hex64(hash)},
    };
    write_file_atomically(o.summary_path, s.dump(2) + "\n");
  }
  std::printf("rank %d of %d: trained %lld steps, test accuracy %.2f%%, parameters fnv1a64 %s\n",
              rank, world, static_cast<long long>(state.step), 100.0 * final_eval.accuracy,
              hex64(hash).c_str());
  std::fflush(stdout);
  // Rank 0 hosts the store: nobody leaves while another rank may still need it.
  comm::BarrierOptions bopts;
  bopts.timeout = timeout;
  pg->barrier(bopts)->wait();
}

}  // namespace tdist::train
