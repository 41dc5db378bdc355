#include "apps/train/pipeline_strategy.h"

#include <torch/torch.h>

#include "tdist/comm/device_mesh.h"
#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"
#include "tdist/ddp/distributed_data_parallel.h"
#include "tdist/ddp/reducer.h"
#include "tdist/fsdp/param_group.h"
#include "tdist/pipeline/pipeline.h"

namespace tdist::train {
namespace {

using ChunkDDP = ddp::DistributedDataParallel<torch::nn::Sequential>;

// A module over tensors it does not own, so that a rank's part goes through tdist-train's one
// checkpoint format (save_checkpoint / load_checkpoint): parameters p0, p1, ... in order.
struct PartModule : torch::nn::Module {
  explicit PartModule(const std::vector<at::Tensor>& tensors) {
    for (size_t i = 0; i < tensors.size(); ++i) register_parameter(str("p", i), tensors[i]);
  }
};

std::string part_dir(const std::string& dir, int world_rank) {
  return dir + "/rank-" + std::to_string(world_rank);
}

bool has_parameters(const torch::nn::Module& m) { return !m.parameters().empty(); }

// Virtual-stage bounds over `layers` (see the file comment of pipeline_strategy.h): the layers
// where a unit starts, dealt evenly to `parts` stages; stage 0 starts at layer 0, the last ends
// at the last layer.
std::vector<int64_t> stage_bounds(torch::nn::Sequential layers, bool language_model, int parts,
                                  int stages) {
  const auto n_layers = static_cast<int64_t>(layers->size());
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < n_layers; ++i) {
    const bool unit = language_model ? (i >= 1 && i + 1 < n_layers)
                                     : has_parameters(*layers[static_cast<size_t>(i)]);
    if (unit) starts.push_back(i);
  }
  const auto units = static_cast<int64_t>(starts.size());
  TDIST_CHECK_ARG(units >= parts, "--pp-stages ", stages, ": the model has ", units,
                  language_model ? " blocks" : " layers with parameters", ", fewer than the ",
                  parts, " pipeline stages it would be cut into",
                  parts > stages ? " (the interleaved schedule puts two on each rank)" : "",
                  language_model ? "; give --layers at least that many" : "");
  std::vector<int64_t> bounds{0};
  for (int s = 1; s < parts; ++s) bounds.push_back(starts[static_cast<size_t>(units * s / parts)]);
  bounds.push_back(n_layers);
  return bounds;
}

}  // namespace

struct PipelineStrategy::Impl {
  TrainModel model;
  std::shared_ptr<comm::DeviceMesh> mesh;
  // config.shard_size: each stage's replicas as {replicate, shard} (its groups shard the stage).
  std::unique_ptr<comm::DeviceMesh> dp_mesh;
  PipelineConfig config;
  std::unique_ptr<pipeline::Pipeline> pipe;
  std::vector<std::unique_ptr<ChunkDDP>> ddps;  // per chunk; null: no DDP over it
  // config.shard: per chunk with parameters, its parameters sharded across the dp group (or,
  // with shard_size, its shard groups).
  std::vector<std::unique_ptr<fsdp::ParamGroup>> shards;
  // The parameters of the layers no chunk of this rank holds, with their shapes: empty while
  // training, allocated and filled by sync_full_model() until the next step.
  std::vector<std::pair<at::Tensor, std::vector<int64_t>>> others;
  bool full = false;   // sync_full_model() ran since the last step
  bool ready = false;  // set up (at the first step)
  // The current step's counts, added to by the loss function on the last stage.
  int64_t correct = 0;
  int64_t predictions = 0;
};

PipelineStrategy::PipelineStrategy(
    TrainModel model, bool language_model, std::shared_ptr<comm::DeviceMesh> mesh,
    PipelineConfig config, std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss,
    ddp::DDPOptions ddp_options)
    : impl_(std::make_unique<Impl>()) {
  Impl& d = *impl_;
  d.model = std::move(model);
  d.mesh = std::move(mesh);
  d.config = std::move(config);
  const auto kind = pipeline::parse_schedule(d.config.schedule);
  const int p = d.mesh->size("pp");
  TDIST_CHECK_ARG(p == d.config.stages, "PipelineStrategy: the mesh's pp dimension is ", p,
                  ", not --pp-stages ", d.config.stages);
  const int parts = kind == pipeline::ScheduleKind::kInterleaved1F1B ? 2 * p : p;
  auto layers = d.model->layers();
  pipeline::PipelineStage stage(layers, stage_bounds(layers, language_model, parts, p),
                                d.mesh->coordinate("pp"), p);
  const auto& dp_group = d.mesh->group("dp");
  fsdp::ShardingConfig sc;
  sc.shard_pg = dp_group;
  sc.timeout = d.config.timeout;
  if (d.config.bf16) sc.param_dtype = at::kBFloat16;
  const int replicas = dp_group->size();
  if (d.config.shard && d.config.shard_size > 0) {
    TDIST_CHECK_ARG(replicas % d.config.shard_size == 0, "--shard-size ", d.config.shard_size,
                    " does not divide the ", replicas,
                    " data-parallel replicas of each pipeline stage (world size / --pp-stages)");
  }
  if (d.config.shard && d.config.shard_size > 0 && d.config.shard_size < replicas) {
    // A collective over the stage's replicas (Note [Device mesh layout]: shard groups of
    // consecutive dp coordinates).
    d.dp_mesh = std::make_unique<comm::DeviceMesh>(
        dp_group, std::vector<comm::DeviceMesh::Dim>{{"replicate", replicas / d.config.shard_size},
                                                     {"shard", d.config.shard_size}});
    sc.shard_pg = d.dp_mesh->group("shard");
    sc.replicate_pg = d.dp_mesh->group("replicate");
  }
  for (int c = 0; c < stage.num_chunks(); ++c) {
    auto chunk = stage.chunk(c);
    if (d.config.shard && has_parameters(*chunk)) {
      // Not fully_shard: its units expect one backward per forward, and a schedule runs the
      // forwards of several microbatches before their backwards. A ParamGroup is what it
      // shards with, driven here once per step (see step()).
      std::vector<std::string> names;
      for (const auto& item : chunk->named_parameters()) names.push_back(item.key());
      d.shards.push_back(std::make_unique<fsdp::ParamGroup>(
          stage.describe_stage(stage.stage_index(c)), chunk->parameters(), std::move(names), sc));
      d.ddps.push_back(nullptr);
    } else if (dp_group->size() > 1 && has_parameters(*chunk)) {
      ddp::DDPOptions o = ddp_options;
      o.timeout = d.config.timeout;
      d.ddps.push_back(std::make_unique<ChunkDDP>(chunk, dp_group, o));
    } else {
      d.ddps.push_back(nullptr);
    }
  }
  pipeline::PipelineOptions o;
  o.schedule = kind;
  o.microbatches = d.config.microbatches;
  o.timeout = d.config.timeout;
  Impl* self = impl_.get();
  o.loss_fn = [self, loss = std::move(loss)](const at::Tensor& out, const at::Tensor& y) {
    {
      torch::NoGradGuard no_grad;
      self->correct += out.argmax(-1).eq(y).sum().item<int64_t>();
      self->predictions += y.numel();
    }
    return loss(out, y);
  };
  o.before_last_weight_pass = [self](int c, const std::vector<at::Tensor>& roots) {
    auto& ddp = self->ddps[static_cast<size_t>(c)];
    if (!ddp) return;
    ddp->reducer().prepare_for_forward();
    ddp->reducer().prepare_for_backward(roots);
  };
  // Layers outside this rank's chunks: their parameters are dropped (and gathered back only
  // by sync_full_model).
  const auto& bounds = stage.bounds();
  std::vector<bool> mine(layers->size(), false);
  for (int c = 0; c < stage.num_chunks(); ++c) {
    const auto s = static_cast<size_t>(stage.stage_index(c));
    for (int64_t l = bounds[s]; l < bounds[s + 1]; ++l) mine[static_cast<size_t>(l)] = true;
  }
  for (size_t l = 0; l < layers->size(); ++l) {
    if (mine[l]) continue;
    for (auto& p : layers[l]->parameters()) d.others.emplace_back(p, p.sizes().vec());
  }
  d.pipe = std::make_unique<pipeline::Pipeline>(std::move(stage), d.mesh->group("pp"), o);
  drop_others();
}

void PipelineStrategy::drop_others() {
  Impl& d = *impl_;
  torch::NoGradGuard no_grad;
  for (auto& [p, shape] : d.others) {
    p.set_data(at::empty({0}, p.options()));
    p.mutable_grad() = at::Tensor();
  }
  for (auto& g : d.shards) g->reshard();
  d.full = false;
}

PipelineStrategy::~PipelineStrategy() = default;

std::vector<at::Tensor> PipelineStrategy::parameters() const {
  if (impl_->config.shard) {
    std::vector<at::Tensor> out;
    for (const auto& g : impl_->shards) out.push_back(g->sharded_param());
    return out;
  }
  return impl_->pipe->stage().parameters();
}

bool PipelineStrategy::sharded() const { return impl_->config.shard; }

PipelineStepResult PipelineStrategy::step(const at::Tensor& inputs, const at::Tensor& labels) {
  Impl& d = *impl_;
  // Sharded: every chunk gathered once for all microbatches; their gradients accumulate in the
  // full parameters' .grad and are reduce-scattered (averaged over the replicas) once.
  const at::Tensor x = prepare(inputs);
  d.correct = 0;
  d.predictions = 0;
  at::Tensor loss = d.pipe->step(x, labels);
  for (auto& g : d.shards) g->reduce_grads();
  for (auto& g : d.shards) {
    g->reshard();
    g->finish_reduce();
  }
  PipelineStepResult r;
  r.has_loss = loss.defined();
  if (r.has_loss) r.loss = loss.item<double>();
  r.correct = d.correct;
  r.predictions = d.predictions;
  const auto& tl = d.pipe->last_timeline();
  double compute_us = 0;
  for (const auto& e : tl.events) {
    if (!e.compute) continue;
    const double us = static_cast<double>(e.end_us - e.begin_us);
    compute_us += us;
    (e.name[0] == 'F' ? r.compute_forward_ms : r.compute_backward_ms) += us / 1e3;
  }
  r.idle_ms = (static_cast<double>(tl.end_us - tl.begin_us) - compute_us) / 1e3;
  return r;
}

at::Tensor PipelineStrategy::prepare(const at::Tensor& inputs) {
  Impl& d = *impl_;
  if (d.full) drop_others();
  for (auto& g : d.shards) g->unshard();
  const at::Tensor x =
      d.config.bf16 && inputs.is_floating_point() ? inputs.to(at::kBFloat16) : inputs;
  if (!d.ready) {
    d.pipe->setup(torch::zeros_like(x));
    d.ready = true;
  }
  return x;
}

at::Tensor PipelineStrategy::eval(const at::Tensor& inputs) {
  Impl& d = *impl_;
  const at::Tensor x = prepare(inputs);
  at::Tensor logits = d.pipe->eval(x).output;
  for (auto& g : d.shards) g->reshard();
  return logits;
}

void PipelineStrategy::sync_full_model() {
  Impl& d = *impl_;
  auto layers = d.model->layers();
  const auto& stage = d.pipe->stage();
  const auto& bounds = stage.bounds();
  const auto& pp = d.mesh->group("pp");
  torch::NoGradGuard no_grad;
  // The sharded stages' values in the model's dtype (not unshard(): under bf16 it gathers bf16
  // views), which the next prepare() replaces with the gathered views again.
  for (auto& g : d.shards) {
    std::vector<at::Tensor> full = g->gather_full();
    for (size_t i = 0; i < full.size(); ++i) g->params()[i].set_data(full[i]);
  }
  for (auto& [p, shape] : d.others) p.set_data(at::empty(shape, p.options()));
  d.full = true;
  // One broadcast per stage rank: its virtual stages' parameters, flattened in order.
  for (int r = 0; r < pp->size(); ++r) {
    std::vector<at::Tensor> params;
    for (int s = r; s + 1 < static_cast<int>(bounds.size()); s += pp->size()) {
      for (int64_t l = bounds[static_cast<size_t>(s)]; l < bounds[static_cast<size_t>(s) + 1];
           ++l) {
        for (auto& p : layers[static_cast<size_t>(l)]->parameters()) params.push_back(p);
      }
    }
    if (params.empty()) continue;
    at::Tensor flat;
    if (r == pp->rank()) {
      std::vector<at::Tensor> flat_parts;
      for (auto& p : params) flat_parts.push_back(p.detach().reshape({-1}));
      flat = torch::cat(flat_parts);
    } else {
      int64_t numel = 0;
      for (auto& p : params) numel += p.numel();
      flat = at::empty({numel}, params.front().options());
    }
    comm::BroadcastOptions o;
    o.root = r;
    o.timeout = d.config.timeout;
    pp->broadcast(flat, o)->wait();
    if (r == pp->rank()) continue;
    int64_t offset = 0;
    for (auto& p : params) {
      p.detach().copy_(flat.narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
    }
  }
}

void PipelineStrategy::save_part(const std::string& dir, int world_rank,
                                 const torch::optim::Optimizer& optimizer, const TrainState& state,
                                 const std::string& fingerprint) const {
  PartModule part(parameters());
  save_checkpoint(part_dir(dir, world_rank), part, optimizer, state, fingerprint);
}

void PipelineStrategy::load_part(const std::string& dir, int world_rank,
                                 torch::optim::Optimizer& optimizer,
                                 const std::string& fingerprint) {
  const std::string at = part_dir(dir, world_rank);
  auto bytes = read_checkpoint_file(at);
  if (!bytes) {
    throw InvalidArgument(str("the pipelined checkpoint has no part for rank ", world_rank, " (no ",
                              checkpoint_path(at),
                              "); a pipelined run resumes at the "
                              "world size and --pp-stages it was written at, with its directory "
                              "readable by every rank"));
  }
  PartModule part(parameters());
  load_checkpoint(*bytes, part, optimizer, fingerprint,
                  parameters().empty() ? c10::Device(c10::kCPU) : parameters().front().device());
}

std::string PipelineStrategy::describe() const {
  const Impl& d = *impl_;
  const auto& stage = d.pipe->stage();
  std::string parts;
  for (int c = 0; c < stage.num_chunks(); ++c) {
    parts += (c ? ", " : "") + stage.describe_stage(stage.stage_index(c));
  }
  return str("pp ", d.mesh->size("pp"), " x dp ", d.mesh->size("dp"),
             d.dp_mesh ? str(" (", d.dp_mesh->size("replicate"), " replicas of shard groups of ",
                             d.dp_mesh->size("shard"), ")")
                       : std::string(),
             ", ", d.config.schedule, ", ", d.config.microbatches,
             " microbatches; this rank: ", parts);
}

}  // namespace tdist::train
