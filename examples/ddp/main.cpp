// Trains a small MLP with tdist's DistributedDataParallel, one process per rank:
//   tdist-run --nproc-per-node 2 ./ddp_example
// Each rank draws its own batches of a learnable task (y = sum(sin(x))); DDP averages the
// gradients, so every rank ends with the same parameters, which the program checks.
#include <torch/torch.h>

#include <cstdio>

#include "tdist/comm/process_group.h"
#include "tdist/ddp/distributed_data_parallel.h"

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(8, 32))),
        fc2(register_module("fc2", torch::nn::Linear(32, 1))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Mlp);

torch::Tensor target(const torch::Tensor& x) { return torch::sin(x).sum(1, true); }

int main() {
  torch::set_num_threads(1);
  // RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from tdist-run.
  auto pg = tdist::comm::create_process_group("env://");
  const int rank = pg->rank();

  torch::manual_seed(0);  // the same held-out batch on every rank
  const torch::Tensor test_x = torch::randn({256, 8});
  torch::manual_seed(1 + rank);  // different initial weights and data per rank
  tdist::ddp::DistributedDataParallel<Mlp> model(Mlp(), pg);  // rank 0's weights win
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  auto test_loss = [&] {
    torch::NoGradGuard no_grad;
    return torch::mse_loss(model.module()->forward(test_x), target(test_x)).item<double>();
  };
  const double before = test_loss();
  for (int step = 0; step < 300; ++step) {
    torch::Tensor x = torch::randn({32, 8});
    opt.zero_grad();
    torch::Tensor loss = torch::mse_loss(model(x), target(x));
    loss.backward();  // gradients are averaged across the ranks here
    opt.step();
    if (step % 50 == 0)
      std::printf("rank %d step %3d: loss %.4f\n", rank, step, loss.item<double>());
  }
  const double after = test_loss();

  // Every rank must hold the same parameters: compare the element-wise max and min across ranks.
  std::vector<torch::Tensor> flat;
  for (const auto& p : model.parameters()) flat.push_back(p.detach().flatten());
  torch::Tensor hi = torch::cat(flat), lo = hi.clone();
  tdist::comm::AllreduceOptions max_op, min_op;
  max_op.op = tdist::comm::ReduceOp::MAX;
  min_op.op = tdist::comm::ReduceOp::MIN;
  pg->allreduce(hi, max_op)->wait();
  pg->allreduce(lo, min_op)->wait();
  const double spread = (hi - lo).abs().max().item<double>();
  pg->barrier()->wait();  // rank 0 hosts the store: nobody leaves before everyone is done

  std::printf("rank %d: held-out loss %.4f -> %.4f; parameters differ across ranks by %g\n", rank,
              before, after, spread);
  const bool ok = spread == 0 && after < before / 4;
  if (!ok) std::fprintf(stderr, "rank %d: FAILED\n", rank);
  return ok ? 0 : 1;
}
