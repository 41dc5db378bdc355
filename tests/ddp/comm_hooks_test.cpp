// Communication hooks: fp16/bf16 compression, PowerSGD, user hooks.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>

#include "tdist/ddp/comm_hooks.h"
#include "tdist/ddp/reducer.h"
#include "tests/ddp/ddp_test_util.h"

namespace tdist::test {
namespace {

using ddp::CommHook;
using ddp::DDPOptions;
using ddp::DistributedDataParallel;

// One synchronized backward of an MLP over `world` ranks (rank r on its own fixed data);
// returns every rank's averaged gradients.
std::vector<std::vector<torch::Tensor>> grads_after_backward(int world,
                                                             std::function<CommHook()> hook,
                                                             DDPOptions opts = {}) {
  torch::set_num_threads(1);
  auto batches = make_batches(1, 4 * world, {6}, 3, 77);
  torch::manual_seed(3);  // the same initial model in every call
  MLP init_net;
  auto init = state_of(*init_net);
  std::vector<std::vector<torch::Tensor>> grads(world);
  run_ranks(world, [&](int rank, std::shared_ptr<comm::ProcessGroup> pg) {
    MLP net;
    if (rank == 0) load_state(*net, init);
    DistributedDataParallel<MLP> model(net, pg, opts);
    if (hook) model.register_comm_hook(hook());
    auto x = shard(batches[0].x, rank, world);
    auto y = shard(batches[0].y, rank, world);
    torch::mse_loss(model(x), y).backward();
    for (auto& p : net->parameters()) grads[rank].push_back(p.grad().clone());
  });
  return grads;
}

double max_abs(const std::vector<torch::Tensor>& ts) {
  double m = 0;
  for (auto& t : ts) m = std::max(m, t.abs().max().item<double>());
  return m;
}

void expect_close_to_plain(std::function<CommHook()> hook, double rel_tol, DDPOptions opts = {},
                           int world = 2, bool expect_difference = true) {
  auto plain = grads_after_backward(world, nullptr, opts);
  auto hooked = grads_after_backward(world, hook, opts);
  const double scale = max_abs(plain[0]);
  ASSERT_GT(scale, 0);
  for (int r = 0; r < world; ++r) {
    double diff = max_abs_diff(plain[0], hooked[r]);
    EXPECT_LE(diff, rel_tol * scale) << "rank " << r;
    if (expect_difference && r == 0) {
      EXPECT_GT(diff, 0.0) << "the hook's rounding left no trace: was it used?";
    }
    EXPECT_EQ(max_abs_diff(hooked[0], hooked[r]), 0.0) << "ranks disagree, rank " << r;
  }
}

TEST(DDPCommHooks, Fp16CompressWithinHalfPrecision) {
  // float16 keeps 11 significant bits: relative error about 2^-11 per rounding.
  expect_close_to_plain(ddp::fp16_compress_hook, 2e-3);
}

TEST(DDPCommHooks, Bf16CompressWithinBfloat16Precision) {
  // bfloat16 keeps 8 significant bits: relative error about 2^-8 per rounding.
  expect_close_to_plain(ddp::bf16_compress_hook, 1.6e-2, {}, 3);
}

TEST(DDPCommHooks, PowerSGDAtFullRankEqualsAllreduce) {
  // With rank >= min(n, m) the approximation P P^T M is exact: PowerSGD must then agree with
  // plain allreduce up to float rounding, over many buckets (ordering through its worker).
  ddp::PowerSGDOptions p;
  p.matrix_approximation_rank = 8;
  p.start_powerSGD_iter = 0;
  p.min_compression_rate = 0;
  DDPOptions opts;
  opts.bucket_cap_mb = 1e-6;
  expect_close_to_plain([p] { return ddp::powersgd_hook(p); }, 1e-4, opts, 3,
                        /*expect_difference=*/false);
}

TEST(DDPCommHooks, PowerSGDLowRankDiffersFromAllreduce) {
  // Rank 1 cannot represent these gradients exactly: the result must differ (compression ran).
  ddp::PowerSGDOptions p;
  p.matrix_approximation_rank = 1;
  p.start_powerSGD_iter = 0;
  p.min_compression_rate = 0;
  auto plain = grads_after_backward(2, nullptr);
  auto low = grads_after_backward(2, [p] { return ddp::powersgd_hook(p); });
  EXPECT_GT(max_abs_diff(plain[0], low[0]), 1e-4);
  EXPECT_EQ(max_abs_diff(low[0], low[1]), 0.0);
  // Biases (vectors) travel uncompressed: equal to plain allreduce.
  EXPECT_LE((plain[0][1] - low[0][1]).abs().max().item<double>(), 1e-6);
}

struct WideImpl : torch::nn::Module {
  WideImpl()
      : fc1(register_module("fc1", torch::nn::Linear(32, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 8))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Wide);

// Trains a student to imitate a fixed teacher; returns the final loss on the whole data set.
double train_toy(std::function<CommHook()> hook, int steps) {
  torch::set_num_threads(1);
  const int world = 2;
  auto gen = at::detail::createCPUGenerator(5);
  auto x = at::randn({128, 32}, gen, at::TensorOptions());
  auto teacher_w = at::randn({32, 8}, gen, at::TensorOptions()) / 4;
  auto y = at::tanh(x.mm(teacher_w));
  torch::manual_seed(11);
  Wide init_net;
  auto init = state_of(*init_net);
  double final_loss = 0;
  run_ranks(world, [&](int rank, std::shared_ptr<comm::ProcessGroup> pg) {
    Wide net;
    if (rank == 0) load_state(*net, init);
    DistributedDataParallel<Wide> model(net, pg);
    if (hook) model.register_comm_hook(hook());
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      torch::mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward();
      opt.step();
    }
    if (rank == 0) {
      torch::NoGradGuard g;
      final_loss = torch::mse_loss(net->forward(x), y).item<double>();
    }
  });
  return final_loss;
}

TEST(DDPCommHooks, PowerSGDReachesAllreduceLossOnToyTask) {
  // Stated margin: after 150 steps PowerSGD (rank 2, error feedback, warm start, compressing
  // from step 10) ends within 1.5x of plain allreduce's loss, plus 1e-3 absolute.
  const int steps = 150;
  double start = train_toy(nullptr, 0);
  double plain = train_toy(nullptr, steps);
  ddp::PowerSGDOptions p;
  p.matrix_approximation_rank = 2;
  p.start_powerSGD_iter = 10;
  double psgd = train_toy([p] { return ddp::powersgd_hook(p); }, steps);
  std::cout << "toy task loss: start " << start << ", allreduce " << plain << ", PowerSGD " << psgd
            << "\n";
  EXPECT_LT(plain, start * 0.2) << "the toy task did not train";
  EXPECT_LE(psgd, plain * 1.5 + 1e-3) << "plain " << plain << ", PowerSGD " << psgd;
}

TEST(DDPCommHooks, UserHookCalledPerBucketAndUsed) {
  std::atomic<int> calls{0};
  auto hook = [&calls]() -> CommHook {
    return [&calls](ddp::GradBucket& bucket) {
      ++calls;
      comm::AllreduceOptions o;
      o.op = comm::ReduceOp::AVG;
      return bucket.process_group()->allreduce(bucket.buffer(), o)->future();
    };
  };
  ParityCase<MLP> c;
  c.make = [] { return MLP(); };
  c.world = 2;
  c.steps = 3;
  c.opts.bucket_cap_mb = 1e-6;  // 6 buckets
  c.hook = hook;
  expect_parity(c, {6});
  EXPECT_EQ(calls.load(), 2 * 3 * 6);
}

TEST(DDPCommHooks, HookResultOfWrongSizeIsAnError) {
  run_ranks(1, [&](int, std::shared_ptr<comm::ProcessGroup> pg) {
    MLP net;
    DistributedDataParallel<MLP> model(net, pg);
    model.register_comm_hook(
        [](ddp::GradBucket&) { return comm::Future::completed({torch::zeros({1})}); });
    EXPECT_THROW(torch::mse_loss(model(torch::randn({2, 6})), torch::zeros({2, 3})).backward(),
                 std::exception);
  });
}

}  // namespace
}  // namespace tdist::test
