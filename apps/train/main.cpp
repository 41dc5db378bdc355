// tdist-train: trains a classifier of 28x28 images or a byte-level GPT, data parallel: with
// DistributedDataParallel, fully_shard (FSDP) or DDP with a ZeroRedundancyOptimizer.
//
//   tdist-run --nproc-per-node 2 tdist-train --dataset synthetic --model mlp --steps 500
//   tdist-train --data-dir ~/mnist --model conv --epochs 2 --optimizer adam   (one process)
//   tdist-run --nproc-per-node 2 tdist-train --model gpt --strategy fsdp --optimizer adam
//       --steps 200   (the gpt on the Python standard library's sources)
//
// Exit codes: 0 done; 1 training failed (a peer died, a timeout, an I/O error); 2 bad flags or
// bad input (missing data directory, malformed IDX file, a checkpoint of another run).
// See docs/train.md.
#include <CLI/CLI.hpp>

#include <iostream>

#include "apps/common/device.h"
#include "apps/train/idx.h"
#include "apps/train/trainer.h"
#include "tdist/core/error.h"

int main(int argc, char** argv) {
  using tdist::train::TrainOptions;
  TrainOptions o;
  CLI::App app{
      "tdist-train: data-parallel training of a 28x28 image classifier or a byte-level "
      "GPT with tdist (DDP, FSDP or ZeRO-1)",
      "tdist-train"};
  app.option_defaults()->always_capture_default();

  auto* model = app.add_option_group("Model");
  model->add_option("--model", o.model.kind, "mlp, conv or gpt (a byte-level transformer)")
      ->check(CLI::IsMember({"mlp", "conv", "gpt"}));
  auto* hidden =
      model->add_option("--hidden", o.model.hidden, "hidden width (mlp layers, conv's dense layer)")
          ->check(CLI::Range(int64_t{1}, int64_t{65536}));
  auto* layers = model
                     ->add_option("--layers", o.model.layers,
                                  "mlp: number of hidden layers; gpt: transformer blocks")
                     ->check(CLI::Range(int64_t{0}, int64_t{256}))
                     ->default_str("mlp 2, gpt 4");
  auto* width =
      model->add_option("--width", o.model.width, "gpt: embedding width (a multiple of --heads)")
          ->check(CLI::Range(int64_t{1}, int64_t{65536}));
  auto* heads = model->add_option("--heads", o.model.heads, "gpt: attention heads")
                    ->check(CLI::Range(int64_t{1}, int64_t{1024}));
  auto* context = model->add_option("--context", o.model.context, "gpt: bytes per sequence")
                      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));

  auto* data = app.add_option_group("Data");
  data->add_option("--dataset", o.data.dataset,
                   "synthetic, mnist (implied by --data-dir), fashion-mnist (from --data-dir, "
                   "default " +
                       std::string(tdist::train::kFashionMnistDir) +
                       ") or text (for "
                       "--model gpt, implied by it: the *.py files under --data-dir, default the "
                       "Python standard library's, /usr/lib/python3.N)")
      ->check(CLI::IsMember({"synthetic", "mnist", "fashion-mnist", "text"}));
  auto* data_dir = data->add_option("--data-dir", o.data.data_dir,
                                    "directory with the IDX files, plain or .gz "
                                    "(train-images-idx3-ubyte, train-labels-idx1-ubyte, "
                                    "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte); text: "
                                    "a tree of .py files");
  data->add_option("--train-samples", o.data.train_samples,
                   "synthetic: training set size; (fashion-)mnist: use at most this many (0: all)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  data->add_option("--test-samples", o.data.test_samples,
                   "synthetic: test set size; (fashion-)mnist: use at most this many (0: all); "
                   "text: held-out windows, spread evenly (default " +
                       std::to_string(tdist::train::kDefaultTextTestSamples) + "; 0: all)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));

  data->add_option("--signal", o.data.signal,
                   "synthetic: strength of the class patterns against unit noise (lower: harder)")
      ->check(CLI::Range(0.0, 100.0));

  auto* train = app.add_option_group("Training");
  train->add_option("--optimizer", o.optimizer, "sgd or adam")
      ->check(CLI::IsMember({"sgd", "adam"}));
  train->add_option("--lr", o.lr, "learning rate")
      ->check(CLI::PositiveNumber)
      ->default_str("sgd 0.05, adam 0.001");
  train->add_option("--momentum", o.momentum, "sgd momentum")->check(CLI::Range(0.0, 1.0));
  train->add_option("--weight-decay", o.weight_decay, "L2 penalty")->check(CLI::NonNegativeNumber);
  auto* epochs = train->add_option("--epochs", o.epochs, "passes over the training set")
                     ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
                     ->default_str("1 unless --steps");
  auto* steps = train->add_option("--steps", o.steps, "optimizer steps (instead of --epochs)")
                    ->check(CLI::Range(int64_t{1}, int64_t{1} << 40))
                    ->default_str("");
  epochs->excludes(steps);
  train->add_option("--batch-size", o.batch_size, "samples per step on each rank")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  train->add_option("--seed", o.seed, "seed of the model, the data and the sampler");
  train->add_option("--threads", o.threads, "intra-op threads (0: libtorch's default)")
      ->check(CLI::Range(0, 1024));
  train->add_option("--timeout", o.timeout_s, "seconds any collective may take")
      ->check(CLI::Range(0.1, 86400.0));
  std::string device = "cpu";
  train
      ->add_option("--device", device,
                   "cpu, cuda (GPU LOCAL_RANK) or auto (cuda when a GPU is visible, else cpu)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  train->add_option("--group-backend", o.group_backend,
                    "the process group's backend: auto (NCCL for CUDA tensors where a GPU is "
                    "visible, else ring), ring, or one per device type, e.g. cpu:ring,cuda:nccl "
                    "(docs/comm.md)");

  auto* strategy = app.add_option_group("Strategy");
  strategy
      ->add_option("--strategy", o.strategy,
                   "ddp (a whole replica per rank), fsdp (parameters, gradients and optimizer "
                   "state sharded: fully_shard; a gpt's blocks are its units), hsdp (fsdp "
                   "inside groups of --shard-size ranks, replicated across them) or zero1 "
                   "(DDP with the optimizer state sharded: ZeroRedundancyOptimizer)")
      ->check(CLI::IsMember({"ddp", "fsdp", "hsdp", "zero1"}));
  auto* reshard = strategy->add_option("--reshard-after-forward", o.reshard_after_forward,
                                       "fsdp, hsdp: free each unit's gathered parameters after "
                                       "its forward (true) or keep them to its backward (false)");
  strategy->add_option(
      "--shard-size", o.shard_size,
      "hsdp: ranks per shard group (divides the world size; with --pp-stages P, world / P)");
  strategy
      ->add_option("--mixed-precision", o.mixed_precision,
                   "fsdp, hsdp: none, or bf16 (parameters gathered and units computed in "
                   "bf16; fp32 shards, gradients reduced in fp32)")
      ->check(CLI::IsMember({"none", "bf16"}));

  auto* pp = app.add_option_group("Pipeline");
  pp->add_option(
        "--pp-stages", o.pp_stages,
        "pipeline stages: the world is pp-stages x data-parallel replicas (DDP, fsdp or "
        "hsdp across them); a gpt's blocks, or a classifier's layers, are cut into the stages")
      ->check(CLI::Range(1, 1024));
  pp->add_option("--schedule", o.schedule,
                 "with --pp-stages > 1: gpipe, 1f1b, interleaved (two stages per rank) or zb "
                 "(zero-bubble ZB-H1)")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zb"}));
  pp->add_option("--microbatches", o.microbatches,
                 "with --pp-stages > 1: microbatches per step (divides --batch-size)")
      ->check(CLI::Range(1, 1 << 20));

  auto* ddp = app.add_option_group("DDP");
  ddp->add_option("--bucket-cap-mb", o.ddp.bucket_cap_mb, "gradient bucket size (MiB)")
      ->check(CLI::Range(0.0, 65536.0));
  ddp->add_option("--first-bucket-cap-mb", o.ddp.first_bucket_cap_mb, "first bucket's size (MiB)")
      ->check(CLI::Range(0.0, 65536.0));
  bool no_broadcast_buffers = false;
  ddp->add_flag("--no-broadcast-buffers", no_broadcast_buffers,
                "do not broadcast buffers from rank 0 before each forward");
  ddp->add_flag("--find-unused-parameters", o.ddp.find_unused_parameters,
                "look for parameters that get no gradient");
  ddp->add_flag("--gradient-as-bucket-view", o.ddp.gradient_as_bucket_view,
                "gradients are views into the buckets");
  ddp->add_flag("--static-graph", o.ddp.static_graph, "the set of used parameters never changes");
  ddp->add_option("--comm-hook", o.comm_hook, "allreduce, fp16, bf16 or powersgd")
      ->check(CLI::IsMember({"allreduce", "fp16", "bf16", "powersgd"}));
  ddp->add_option("--powersgd-rank", o.powersgd_rank, "PowerSGD's matrix approximation rank")
      ->check(CLI::Range(1, 1024));

  auto* out = app.add_option_group("Output");
  out->add_option("--progress", o.progress,
                  "auto (a bar on a terminal, else log lines), bar, log, none")
      ->check(CLI::IsMember({"auto", "bar", "log", "none"}));
  out->add_option("--log-every", o.log_every, "steps between progress reports")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  out->add_option("--eval-every", o.eval_every, "steps between test evaluations (0: at the end)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  auto* eval_batch =
      out->add_option("--eval-batch-size", o.eval_batch_size, "samples per evaluation batch")
          ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
          ->default_str("1000; gpt 64");
  out->add_option("--metrics", o.metrics_path, "append JSON lines (per report and evaluation)");
  out->add_option("--summary", o.summary_path, "write a JSON summary of the run");
  out->add_option("--warmup-steps", o.warmup_steps, "steps left out of the summary's samples/s")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));

  auto* ckpt = app.add_option_group("Checkpoints");
  ckpt->add_option("--checkpoint-dir", o.checkpoint_dir, "where rank 0 writes checkpoint.pt");
  ckpt->add_option("--checkpoint-every", o.checkpoint_every,
                   "steps between checkpoints (0: at the end)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  ckpt->add_flag("--resume", o.resume, "continue from the checkpoint in --checkpoint-dir, if any");

  try {
    app.parse(argc, argv);
    o.ddp.broadcast_buffers = !no_broadcast_buffers;
    const bool gpt = o.model.kind == "gpt";
    const bool dataset_given = app.get_option("--dataset")->count() > 0;
    if (gpt && !dataset_given) o.data.dataset = "text";
    if (data_dir->count() > 0) {
      if (o.data.dataset == "synthetic" && dataset_given) {
        throw CLI::ValidationError("--data-dir", "is for --dataset mnist or text, not synthetic");
      }
      if (!dataset_given && !gpt) o.data.dataset = "mnist";
    }
    if (o.data.dataset != "synthetic") {
      // Defaults of the synthetic set sizes mean "everything" for MNIST; text evaluates on
      // kDefaultTextTestSamples held-out windows.
      if (app.get_option("--train-samples")->count() == 0) o.data.train_samples = 0;
      if (app.get_option("--test-samples")->count() == 0) {
        o.data.test_samples = o.data.dataset == "text" ? tdist::train::kDefaultTextTestSamples : 0;
      }
    }
    if (layers->count() > 0 && o.model.kind == "conv") {
      throw CLI::ValidationError("--layers", "applies to --model mlp or gpt");
    }
    if (gpt && layers->count() == 0) o.model.layers = 4;
    if (gpt && eval_batch->count() == 0) o.eval_batch_size = 64;
    if (gpt && hidden->count() > 0) {
      throw CLI::ValidationError("--hidden", "applies to --model mlp or conv (gpt: --width)");
    }
    for (auto* opt : {width, heads, context}) {
      if (!gpt && opt->count() > 0) {
        throw CLI::ValidationError(opt->get_name(), "applies to --model gpt only");
      }
    }
    o.data.context = o.model.context;
    if (reshard->count() > 0 && !o.sharded()) {
      throw CLI::ValidationError("--reshard-after-forward",
                                 "applies to --strategy fsdp or hsdp only");
    }
    if (o.sharded()) {
      for (const auto* opt : ddp->get_options()) {
        if (opt->count() > 0) {
          throw CLI::ValidationError(opt->get_name(),
                                     "is DDP's: it applies to --strategy ddp or "
                                     "zero1, not " +
                                         o.strategy);
        }
      }
    }
    if (epochs->count() == 0 && steps->count() == 0) o.epochs = 1;
    tdist::train::validate(o);
    // Before anything else asks libtorch about CUDA (apps/common/device.h).
    o.device = tdist::apps::resolve_device("--device", device);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "tdist-train: " << e.what() << "\nRun with --help for usage.\n";
    return 2;
  } catch (const tdist::InvalidArgument& e) {
    std::cerr << "tdist-train: " << e.what() << "\nRun with --help for usage.\n";
    return 2;
  }
  try {
    tdist::train::run_training(o);
    return 0;
  } catch (const tdist::InvalidArgument& e) {
    // One write: a launcher may stop this process at any moment after a peer failed.
    std::cerr << "tdist-train: " + std::string(e.what()) + "\n" << std::flush;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "tdist-train: " + std::string(e.what()) + "\n" << std::flush;
    return 1;
  }
}
