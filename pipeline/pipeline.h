#pragma once
// Pipeline parallelism: a torch::nn::Sequential cut into stages over the ranks of a process
// group, trained with a schedule of microbatches (PyTorch's torch.distributed.pipelining, in C++).
//
//   auto pg = tdist::comm::create_process_group("env://");          // p ranks, one per stage
//   torch::nn::Sequential model(...);                                // the same on every rank
//   auto bounds = PipelineStage::balanced_bounds(model, pg->size());
//   PipelineOptions o;
//   o.schedule = ScheduleKind::k1F1B;
//   o.microbatches = 8;
//   o.loss_fn = [](const at::Tensor& out, const at::Tensor& y) { return torch::mse_loss(out, y); };
//   Pipeline pipe(PipelineStage(model, bounds, pg->rank(), pg->size()), pg, o);
//   pipe.setup(x);                          // a batch-shaped sample, on every rank
//   torch::optim::SGD opt(pipe.stage().parameters(), 0.1);
//   opt.zero_grad();
//   auto loss = pipe.step(x, y);            // defined on the last stage's rank only
//   opt.step();
//   auto [out, test_loss] = pipe.eval(x_test, y_test);  // forward only: no gradients
//
// Contract. setup() and step() are collective over the group: every rank calls them in the same
// order. step() runs this rank's action list (Note [Pipeline schedules]) once: microbatch i of
// `inputs` (read on the first stage's rank only) goes forward through every stage, the loss
// (loss_fn, a mean over the microbatch, times 1/m) is taken on the last stage, and gradients of
// all microbatches accumulate into the parameters' .grad, so they equal one backward of the mean
// loss over the whole batch. The returned loss is that mean (last stage's rank; undefined
// elsewhere). Blocking: step() returns when this rank's actions and sends are done.
//
// Failure. Every wait is bounded by the options' timeout (else the group's). A rank whose step
// fails (a peer's connection broke, a timeout, bad input) tells every other rank before it
// throws, so that each fails at once with an Error naming the stage that failed first and why,
// instead of waiting for its own timeout; the pipeline is then broken (later steps throw).
// Construction is collective too: the pipeline talks over its own subgroup of the group's ranks
// (new_group), where it keeps a receive for failure notices posted; the caller's messages on
// the group never meet the pipeline's. Destruction is collective as well unless the pipeline is
// broken: every rank waits (bounded by the timeout) until all are done with the subgroup, since
// a small send completes before its receiver read it. A Pipeline destroyed while an exception
// unwinds its caller (an error outside step(), e.g. in the stage's data-parallel reduction)
// tells every other rank, as a failed step does, and does not wait. Not thread safe: one thread drives a
// Pipeline.
//
// Note [Pipeline schedules]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A schedule is one ordered list of actions per rank, generated once (make_schedule, schedule.h)
// and run by one runtime: F (forward of microbatch i through chunk c), B (its whole backward),
// or, for zero-bubble, I (the gradient of the chunk's input only) and W (its weight gradients).
// The lists come from simulating each schedule's rule with unit costs F = 1, B = 2, I = W = 1;
// every action's inputs exist earlier in simulated time, so running each list in order, each
// action waiting only for its own inputs, cannot deadlock. The simulated timetables for p = 4
// ranks (r0..r3), m = 4 microbatches (one column per unit; B spans two; "." idle):
//
// GPipe: all forwards, then all backwards. Bubble (p-1)/(m+p-1) = 3/7 = 43%; memory: every
// rank stashes all m microbatches' activations.
//   r0 |F0 F1 F2 F3 .  .  .  .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3
//   r1 |.  F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 .  .
//   r2 |.  .  F0 F1 F2 F3 .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 .  .  .  .
//   r3 |.  .  .  F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3 .  .  .  .  .  .
//
// 1F1B: rank r runs p-1-r warm-up forwards, then one forward and one backward in turn, then the
// remaining backwards. Same bubble as GPipe (43%), but at most p - r microbatches in flight
// (stashed) on rank r (4, 3, 2, 1 here), p on rank 0 whatever m.
//   r0 |F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 .  B1 B1 .  B2 B2 .  B3 B3
//   r1 |.  F0 F1 F2 .  .  .  .  B0 B0 F3 B1 B1 .  B2 B2 .  B3 B3 .  .
//   r2 |.  .  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3 .  .  .  .
//   r3 |.  .  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .  .  .  .  .  .
//
// Interleaved 1F1B (v = 2 chunks per rank; virtual stage s on rank s mod p; chunk 1 in lower
// case, and a unit here is one chunk's action: half a stage's): forwards in Megatron's order
// (groups of p microbatches, chunk by chunk), warm-up (v-1)p + 2(p-1-r), then one forward, one
// backward. The bubble shrinks to 27% (43% for 1F1B; about (p-1)/(v m + p-1) for large m), at
// the price of more in flight: up to (v-1)p + 2(p-1-r) + 1 chunk-microbatches on rank r, at most
// v m (8, 8, 7, 5 here: 4, 4, 3.5, 2.5 stages' worth), and twice the messages. For m not a
// multiple of p the warm-up is lengthened until the order completes. (Second half: ">".)
//   r0  |F0 F1 F2 F3 f0 f1 f2 f3 .  .  .  .  .  .  b0 b0 .
//   r1  |.  F0 F1 F2 F3 f0 f1 f2 f3 .  .  .  b0 b0 .  b1 b1
//   r2  |.  .  F0 F1 F2 F3 f0 f1 f2 .  b0 b0 f3 b1 b1 .  b2
//   r3  |.  .  .  F0 F1 F2 F3 f0 b0 b0 f1 b1 b1 f2 b2 b2 f3
//   r0 >|b1 b1 .  b2 b2 .  b3 b3 B0 B0 B1 B1 B2 B2 B3 B3
//   r1 >|.  b2 b2 .  b3 b3 B0 B0 B1 B1 B2 B2 B3 B3 .  .
//   r2 >|b2 .  b3 b3 B0 B0 B1 B1 B2 B2 B3 B3 .  .  .  .
//   r3 >|b3 b3 B0 B0 B1 B1 B2 B2 B3 B3 .  .  .  .  .  .
//
// ZB-H1 (zero bubble, Qi et al.): 1F1B with B split into I and W. I is on the critical path
// (the previous stage waits for it), W is not: a rank that would idle runs a pending W instead,
// and a rank holding p - r microbatches (counted until their W) runs a W before its next
// forward, so memory stays 1F1B's (4, 3, 2, 1). The bubble drops to 33% here (1F1B: 43%).
//   r0 |F0 F1 F2 F3 .  .  .  I0 W0 .  I1 W1 .  I2 W2 .  I3 W3
//   r1 |.  F0 F1 F2 .  .  I0 W0 F3 I1 W1 .  I2 W2 .  I3 W3 .
//   r2 |.  .  F0 F1 .  I0 W0 F2 I1 W1 F3 I2 W2 .  I3 W3 .  .
//   r3 |.  .  .  F0 I0 W0 F1 I1 W1 F2 I2 W2 F3 I3 W3 .  .  .
//
// The split: in zero-bubble schedules the stage runs its chunk layer by layer, each layer's
// input a detached leaf. I walks the layers backwards with autograd::grad(output, input,
// retain_graph), keeping each layer's output gradient. A layer's autograd graph is walked once
// before its I (detail::LayerSplit) for the forks: nodes on the input's gradient path with an
// edge off it that leads to parameters (a Linear's addmm, a LayerNorm). A hook on each keeps
// the gradients I hands it, and W runs one backward per fork from those gradients into the
// parameters it reaches off the path: the autograd engine computes only the outputs that lead
// there, so the fork's node computes its weight products now and nothing of the input's path
// runs twice. A whole backward of a transformer block in W (autograd::backward of the layer's
// output into its parameters, as before) ran the block's internal input-side gradients again:
// 27% slower steps than 1F1B on the GPT benchmark (docs/perf.md, "Pipeline"). W falls back to
// that whole backward for a layer whose I did not run (stage 0's first), one whose forks are
// not exact (a parameter reached off the path at a fork and again below it, which W from that
// fork would count twice), and for a chunk's last W of the step when before_last_weight_pass
// arms DDP (its reducer finishes at the end of the first backward that fires its hooks, so
// that W is one backward).
//
// W placement: the lists come from unit costs, real ones differ (measured W 1.2-2.3x I before
// the forks, the last stage slower than the first: docs/perf-history.md, "Pipeline under load").
// So at run time, while the next action's activation or gradient has not arrived, the rank runs
// its oldest pending W (one whose I ran) instead of waiting; the list's own W for it is then
// skipped. W needs no message, so this cannot deadlock, and it only moves W earlier, so memory
// stays within the list's bound.
//
// Transfers: the activation that virtual stage s receives for microbatch i has tag
// kTagBase + 2(i S + s), its gradient kTagBase + 2(i S + s) + 1 (S virtual stages): one tag per
// microbatch, stage and direction, so receives match whatever order the sends arrive in. A
// rank sends as soon as an output exists, waiting for its sends only at the end of the step,
// and posts each receive (non-blocking) before the action it runs in the simulated timetable
// when the sender starts producing that message, and at the latest p actions before the
// action that needs it (Schedule::receive_post_index): a message larger than the eager limit
// moves only once its receive is posted (Note [Point-to-point protocol]), so a receive posted
// late costs a round trip between the ranks' I/O threads on the critical path, and the
// interleaved schedule's messages cross several actions between send and use.
//
// The bubble, measured: the idle share of the p ranks over one step's makespan, from the start
// of the first action on any rank to the end of the last (pipeline_bubble in timeline.h, which
// tdist-bench pipeline reports): the simulated timetables' definition above, which is also the
// analytic (p-1)/(m+p-1) for GPipe and 1F1B. Time outside the makespan (the optimizer step,
// zero_grad, splitting the batch) is not idle time of the pipeline; the loss is part of the
// last stage's forward, and a message's transfer on the critical path is idle time.
// Buffer shapes come from setup(): the first stage runs the sample's first microbatch, each
// stage tells the next its output shape and runs a zero tensor of that shape; a stage that
// cannot take its neighbour's output fails set-up on every rank, naming both stages.
//
// pp x dp: each stage's data-parallel group may run DDP over the stage's chunks. Gradients of
// all microbatches accumulate locally (DDP's hooks do nothing while not armed) and
// before_last_weight_pass arms the reducer just before the last pass that adds a chunk's weight
// gradients (B of its last microbatch, or W for zero-bubble): that one backward reduces the sum.

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tdist/pipeline/schedule.h"
#include "tdist/pipeline/stage.h"
#include "tdist/pipeline/timeline.h"

namespace tdist::comm {
class ProcessGroup;
}

namespace tdist::pipeline {

// Tags of the pipeline's messages on its own subgroup (Note [Pipeline schedules]).
constexpr int kTagBase = 1 << 20;

struct PipelineOptions {
  ScheduleKind schedule = ScheduleKind::k1F1B;
  int microbatches = 1;
  // loss_fn(output of the last stage for one microbatch, its targets): a scalar, the mean over
  // the microbatch. Required.
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss_fn;
  // Bound of every wait; negative: the group's timeout.
  std::chrono::milliseconds timeout{-1};
  // Called on every rank once per step and chunk, just before the last backward pass that adds
  // to that chunk's weight gradients, with the pass's roots (pp x dp: arm DDP's reducer).
  std::function<void(int chunk, const std::vector<at::Tensor>& roots)> before_last_weight_pass;
  // Set: every step's timeline is written there as Chrome-trace JSON when the Pipeline is
  // destroyed or write_trace() is called ("{rank}" replaced by the rank, else ".rankR" added).
  // Unset: TDIST_PIPELINE_TRACE, read by the constructor.
  std::string trace_path;
};

class Pipeline {
 public:
  // Collective (makes the pipeline's subgroup). Throws InvalidArgument when the group's size or
  // rank differ from the stage's, when m < 1 or loss_fn is missing, or when the schedule does
  // not fit the stage's chunk count.
  Pipeline(PipelineStage stage, std::shared_ptr<comm::ProcessGroup> pg, PipelineOptions opts);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // Collective. `sample` is shaped like a batch of inputs (its values are read on the first
  // stage's rank only). InvalidArgument, on every rank: m does not divide the batch; a stage
  // cannot take its neighbour's output (naming both stages).
  void setup(const at::Tensor& sample);
  // Collective; see the file comment. `inputs` matter on the first stage's rank, `targets` on
  // the last stage's (both shaped like the set-up batch along dim 0); other ranks may pass
  // undefined tensors.
  at::Tensor step(const at::Tensor& inputs, const at::Tensor& targets);

  // Forward only, without autograd (PyTorch's schedule.eval()): microbatch i of `inputs` goes
  // through every stage as in step(), nothing is stashed for a backward and no gradient
  // changes. Collective, with the same arguments as step(), except that `targets` may be
  // undefined on every rank (then no loss is taken). Returns, on the last stage's rank, the
  // last stage's output for the whole batch (the microbatches' outputs concatenated along dim
  // 0) and, with targets, the loss as step() computes it; both undefined on other ranks.
  // Batches have the set-up sample's shape, as in step(). Dropout and the like follow the
  // modules' own train()/eval() mode, which the caller sets. Failures as in step().
  struct EvalResult {
    at::Tensor output;
    at::Tensor loss;
  };
  EvalResult eval(const at::Tensor& inputs, const at::Tensor& targets = {});

  PipelineStage& stage();
  const Schedule& schedule() const;
  // The last step's timeline on this rank, and the share of its own step() call it was idle
  // (that counts its wait for the first input, which includes its neighbours' time between
  // steps; the pipeline's bubble is pipeline_bubble over every rank's timeline: timeline.h).
  const StepTimeline& last_timeline() const;
  double bubble_fraction() const { return last_timeline().idle_fraction(); }
  // Writes every step's timeline so far to the options' trace path (or `path` when given).
  void write_trace(const std::string& path = {}) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tdist::pipeline
