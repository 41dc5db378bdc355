// Trains a small residual MLP three ways on the same batches, one process per rank:
//   tdist-run --nproc-per-node 2 ./fsdp_example
// with fully_shard (FSDP: each block is a unit; parameters, gradients and Adam's state sharded),
// with DDP and a ZeroRedundancyOptimizer (ZeRO-1: Adam's state sharded), and with plain DDP, the
// reference. It prints what each holds per rank and checks that all three end with the same
// parameters.
#include <torch/torch.h>

#include <cstdio>
#include <unordered_set>

#include "tdist/comm/process_group.h"
#include "tdist/ddp/distributed_data_parallel.h"
#include "tdist/fsdp/fully_shard.h"
#include "tdist/fsdp/zero_redundancy_optimizer.h"

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t w)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({w})))),
        fc(register_module("fc", torch::nn::Linear(w, w))) {}
  torch::Tensor forward(torch::Tensor x) { return x + torch::gelu(fc(norm(x))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

// The blocks are called through tdist::fsdp::call: the units' boundaries when sharded, a plain
// forward otherwise (the same model code runs under DDP).
struct NetImpl : torch::nn::Module {
  NetImpl()
      : in(register_module("in", torch::nn::Linear(8, 64))),
        out(register_module("out", torch::nn::Linear(64, 1))) {
    auto list = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 4; ++i) {
      blocks.push_back(Block(64));
      list->push_back(blocks.back());
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    x = in(x);
    for (auto& b : blocks) x = tdist::fsdp::call(b, x);
    return out(x);
  }
  torch::nn::Linear in, out;
  std::vector<Block> blocks;
};
TORCH_MODULE(Net);

torch::Tensor target(const torch::Tensor& x) { return torch::sin(x).sum(1, true); }

// Bytes of the given tensors' storages, each counted once.
size_t bytes_of(const std::vector<torch::Tensor>& ts) {
  std::unordered_set<const void*> seen;
  size_t n = 0;
  for (const auto& t : ts) {
    if (!t.defined()) continue;
    if (seen.insert(t.storage().unsafeGetStorageImpl()).second) n += t.storage().nbytes();
  }
  return n;
}

std::vector<torch::Tensor> grads(const std::vector<torch::Tensor>& ps) {
  std::vector<torch::Tensor> g;
  for (const auto& p : ps) g.push_back(p.grad());
  return g;
}

int main() {
  torch::set_num_threads(1);
  // RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from tdist-run.
  auto pg = tdist::comm::create_process_group("env://");
  const int rank = pg->rank();
  const auto adam = [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adam>(std::move(p), torch::optim::AdamOptions(1e-3));
  };

  torch::manual_seed(0);  // the same initial weights in all three models
  Net a, b, c;
  {
    torch::NoGradGuard no_grad;
    for (auto* m : {&b, &c}) {
      auto src = a->parameters(), dst = (*m)->parameters();
      for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
    }
  }
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  for (auto& block : a->blocks) units.push_back(block.ptr());
  auto fsdp_model = tdist::fsdp::fully_shard(a, units, pg);
  auto fsdp_opt = adam(fsdp_model.parameters());  // an unchanged optimizer, on the shards

  tdist::ddp::DistributedDataParallel<Net> zero_model(b, pg);
  tdist::fsdp::ZeroRedundancyOptimizer zero_opt(zero_model.parameters(), adam, pg);

  tdist::ddp::DistributedDataParallel<Net> ddp_model(c, pg);
  auto ddp_opt = adam(ddp_model.parameters());

  torch::manual_seed(1 + rank);  // each rank its own batches
  for (int step = 0; step < 100; ++step) {
    torch::Tensor x = torch::randn({16, 8});
    fsdp_opt->zero_grad();
    torch::Tensor loss = torch::mse_loss(fsdp_model(x), target(x));
    loss.backward();  // gradients reduce-scattered into the shards here
    fsdp_opt->step();
    zero_opt.zero_grad();
    torch::mse_loss(zero_model(x), target(x)).backward();
    zero_opt.step();  // each rank steps its partition, then the owners broadcast
    ddp_opt->zero_grad();
    torch::mse_loss(ddp_model(x), target(x)).backward();
    ddp_opt->step();
    if (step % 25 == 0) {
      std::printf("rank %d step %3d: loss %.4f\n", rank, step, loss.item<double>());
    }
  }

  // Parameters + gradients + Adam state each holds on this rank, from the tensors.
  const auto fsdp_bytes = bytes_of(fsdp_model.parameters()) +
                          bytes_of(grads(fsdp_model.parameters())) +
                          tdist::fsdp::optimizer_state_bytes(*fsdp_opt);
  const auto zero_bytes = bytes_of(zero_model.parameters()) +
                          bytes_of(grads(zero_model.parameters())) + zero_opt.local_state_bytes();
  const auto ddp_bytes = bytes_of(ddp_model.parameters()) +
                         bytes_of(grads(ddp_model.parameters())) +
                         tdist::fsdp::optimizer_state_bytes(*ddp_opt);

  // The full parameters of the sharded model (a collective) against the two others.
  double fsdp_diff = 0, zero_diff = 0;
  auto full = fsdp_model.full_parameters();
  auto zp = zero_model.parameters(), dp = ddp_model.parameters();
  for (size_t i = 0; i < dp.size(); ++i) {
    fsdp_diff = std::max(fsdp_diff, (full[i].second - dp[i]).abs().max().item<double>());
    zero_diff = std::max(zero_diff, (zp[i] - dp[i]).abs().max().item<double>());
  }
  pg->barrier()->wait();  // rank 0 hosts the store: nobody leaves before everyone is done

  std::printf(
      "rank %d: bytes held (parameters + gradients + Adam state): fsdp %zu, zero1 %zu, "
      "ddp %zu; max difference from ddp: fsdp %g, zero1 %g\n",
      rank, fsdp_bytes, zero_bytes, ddp_bytes, fsdp_diff, zero_diff);
  const bool ok =
      fsdp_diff <= 1e-5 && zero_diff <= 1e-5 && fsdp_bytes < ddp_bytes && zero_bytes < ddp_bytes;
  if (!ok) std::fprintf(stderr, "rank %d: FAILED\n", rank);
  return ok ? 0 : 1;
}
