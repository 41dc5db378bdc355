#pragma once
// tdist-train's pipeline parallelism (--pp-stages P --schedule S --microbatches M): the world is
// laid out as a comm::DeviceMesh {"pp": P, "dp": world / P} (Note [Device mesh layout]: stage s
// holds world ranks s * dp .. s * dp + dp - 1); each "pp" group runs one tdist::pipeline over the
// model's layers() cut into stages, and each stage's "dp" group runs DDP over that stage's
// chunks (armed by the pipeline before the last weight pass, so the gradients of all
// microbatches are reduced once).
//
// The cut: a gpt's blocks are the stages' layers (stage 0 also holds the embedding, the last
// stage the final LayerNorm and head); a classifier's layers with parameters are, each with the
// parameter-free layers after it. Units are dealt in order, as evenly as they go, to the P
// stages (the interleaved schedule: to 2P virtual stages, two per rank).
//
// Every rank builds the whole model from the same seed and trains its stage's part of it; the
// other parts go stale until sync_full_model() (a collective) gives every rank every stage's
// current values, for evaluation and the final parameter hash.
//
// Contract: construction, step() and sync_full_model() are collectives over the world, made in
// the same order on every rank; one thread drives the object; every wait is bounded by the
// timeout given at construction.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "apps/train/models.h"
#include "tdist/ddp/options.h"

namespace tdist::comm {
class DeviceMesh;
}

namespace tdist::train {

struct PipelineConfig {
  int stages = 1;               // --pp-stages
  std::string schedule = "1f1b";  // --schedule: gpipe, 1f1b, interleaved, zb
  int microbatches = 1;         // --microbatches (divides the batch of a replica)
  std::chrono::milliseconds timeout{300000};
};

// One step of the pipeline, as this rank saw it.
struct PipelineStepResult {
  bool has_loss = false;    // this rank holds the last stage
  double loss = 0;          // the mean loss over the batch (last stage)
  int64_t correct = 0;      // right predictions of the batch (last stage)
  int64_t predictions = 0;  // predictions made (last stage)
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

  // This rank's stage's parameters (give them to the optimizer).
  std::vector<at::Tensor> parameters() const;
  // One pipeline step: `inputs` and `labels` are this replica's batch (the same on every stage
  // of the pipeline); gradients land in parameters()' .grad, averaged over the replicas.
  PipelineStepResult step(const at::Tensor& inputs, const at::Tensor& labels);
  // Collective: every rank's model gets every stage's current parameters (a broadcast from each
  // stage's rank within each pipeline).
  void sync_full_model();
  // "pp 2 x dp 2, 1f1b, 4 microbatches; stage 1 (rank 1, layers [3, 6))".
  std::string describe() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tdist::train
