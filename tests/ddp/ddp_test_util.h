#pragma once
// Shared pieces of the ddp tests: running ranks as threads over a process group, small models,
// and the parity harness (N DDP ranks on shards vs one process on the whole batch).

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tdist/comm/process_group.h"
#include "tdist/ddp/distributed_data_parallel.h"
#include "tests/ddp/fake_process_group.h"

namespace tdist::test {

using RankPgFn = std::function<void(int rank, std::shared_ptr<comm::ProcessGroup> pg)>;

// Runs fn on `world` threads, each with its rank's group; joins all and rethrows the first error.
inline void run_ranks(int world, const RankPgFn& fn, comm::ProcessGroup::Options opts = {}) {
  auto groups = make_fake_groups(world, opts);
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, groups[r]);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

// ---- models ----

struct MLPImpl : torch::nn::Module {
  MLPImpl(int in = 6, int hidden = 8, int out = 3)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        fc3(register_module("fc3", torch::nn::Linear(hidden, out))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return fc3(torch::relu(fc2(torch::relu(fc1(x)))));
  }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(MLP);

struct ConvNetImpl : torch::nn::Module {
  ConvNetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 6, 3)))),
        fc(register_module("fc", torch::nn::Linear(6 * 4 * 4, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(conv2(torch::relu(conv1(x))));
    return fc(h.flatten(1));
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc;
};
TORCH_MODULE(ConvNet);

struct BNNetImpl : torch::nn::Module {
  BNNetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(6, 8))),
        bn(register_module("bn", torch::nn::BatchNorm1d(8))),
        fc2(register_module("fc2", torch::nn::Linear(8, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(bn(fc1(x)))); }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear fc2;
};
TORCH_MODULE(BNNet);

// `unused` never takes part; `branch` only for inputs whose first feature sums positive.
struct BranchNetImpl : torch::nn::Module {
  BranchNetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(6, 8))),
        branch(register_module("branch", torch::nn::Linear(8, 8))),
        unused(register_module("unused", torch::nn::Linear(8, 8))),
        fc2(register_module("fc2", torch::nn::Linear(8, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(fc1(x));
    if (x.select(1, 0).sum().item<double>() > 0) h = torch::relu(branch(h));
    return fc2(h);
  }
  torch::nn::Linear fc1, branch, unused, fc2;
};
TORCH_MODULE(BranchNet);

// ---- parity ----

inline std::vector<torch::Tensor> state_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().clone());
  for (auto& b : m.buffers()) out.push_back(b.detach().clone());
  return out;
}

inline void load_state(torch::nn::Module& m, const std::vector<torch::Tensor>& s) {
  torch::NoGradGuard g;
  size_t k = 0;
  for (auto& p : m.parameters()) p.copy_(s.at(k++));
  for (auto& b : m.buffers()) b.copy_(s.at(k++));
}

inline double max_abs_diff(const std::vector<torch::Tensor>& a,
                           const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    m = std::max(m, (a[i].to(torch::kDouble) - b[i].to(torch::kDouble)).abs().max().item<double>());
  }
  return m;
}

struct Batch {
  torch::Tensor x, y;  // the whole batch of every rank (rank r: rows [r*b, (r+1)*b))
};

inline std::vector<Batch> make_batches(int n, int rows, std::vector<int64_t> x_shape, int classes,
                                       uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  std::vector<Batch> out;
  for (int i = 0; i < n; ++i) {
    std::vector<int64_t> shape{rows};
    shape.insert(shape.end(), x_shape.begin(), x_shape.end());
    out.push_back({at::randn(shape, gen, at::TensorOptions()),
                   at::randn({rows, classes}, gen, at::TensorOptions())});
  }
  return out;
}

inline torch::Tensor shard(const torch::Tensor& t, int rank, int world) {
  int64_t b = t.size(0) / world;
  return t.narrow(0, rank * b, b);
}

template <typename Net>
struct ParityCase {
  std::function<Net()> make;
  int world = 2;
  int steps = 3;
  int accumulate = 1;                 // micro-batches per step: all but the last under no_sync
  bool whole_batch_reference = true;  // else the reference runs each shard apart (BatchNorm)
  double lr = 0.1;
  ddp::DDPOptions opts;
  std::function<ddp::CommHook()> hook;  // optional
  // Optional: adjusts the generated batches (e.g. to make shards take different branches).
  std::function<void(std::vector<Batch>&)> adjust_batches;
  // Called on each rank after the last step.
  std::function<void(int rank, ddp::DistributedDataParallel<Net>&)> inspect;
};

// Reference: one process, SGD on the mean loss of the whole batch.
template <typename Net>
std::vector<torch::Tensor> train_reference(const ParityCase<Net>& c,
                                           const std::vector<torch::Tensor>& init,
                                           const std::vector<Batch>& batches) {
  Net net = c.make();
  load_state(*net, init);
  torch::optim::SGD opt(net->parameters(), c.lr);
  size_t k = 0;
  for (int s = 0; s < c.steps; ++s) {
    opt.zero_grad();
    for (int m = 0; m < c.accumulate; ++m, ++k) {
      const Batch& b = batches[k];
      if (c.whole_batch_reference) {
        torch::mse_loss(net->forward(b.x), b.y).backward();
        continue;
      }
      // Each shard sees the same buffers (rank 0's, as DDP broadcasts them); keep shard 0's.
      std::vector<torch::Tensor> buffers, kept;
      for (auto& buf : net->buffers()) buffers.push_back(buf.detach().clone());
      for (int r = 0; r < c.world; ++r) {
        {
          torch::NoGradGuard g;
          size_t i = 0;
          for (auto& buf : net->buffers()) buf.copy_(buffers[i++]);
        }
        auto loss = torch::mse_loss(net->forward(shard(b.x, r, c.world)), shard(b.y, r, c.world));
        (loss / c.world).backward();
        if (r == 0) {
          for (auto& buf : net->buffers()) kept.push_back(buf.detach().clone());
        }
      }
      torch::NoGradGuard g;
      size_t i = 0;
      for (auto& buf : net->buffers()) buf.copy_(kept[i++]);
    }
    opt.step();
  }
  return state_of(*net);
}

// Trains with DDP on `world` threads; returns each rank's final state.
template <typename Net>
std::vector<std::vector<torch::Tensor>> train_ddp(const ParityCase<Net>& c,
                                                  const std::vector<torch::Tensor>& init,
                                                  const std::vector<Batch>& batches) {
  std::vector<std::vector<torch::Tensor>> states(c.world);
  run_ranks(c.world, [&](int rank, std::shared_ptr<comm::ProcessGroup> pg) {
    Net net = c.make();
    if (rank == 0) load_state(*net, init);  // the others get rank 0's by broadcast
    ddp::DistributedDataParallel<Net> model(net, pg, c.opts);
    if (c.hook) model.register_comm_hook(c.hook());
    torch::optim::SGD opt(model.parameters(), c.lr);
    size_t k = 0;
    for (int s = 0; s < c.steps; ++s) {
      opt.zero_grad();
      for (int m = 0; m < c.accumulate; ++m, ++k) {
        auto x = shard(batches[k].x, rank, c.world);
        auto y = shard(batches[k].y, rank, c.world);
        if (m + 1 < c.accumulate) {
          auto guard = model.no_sync();
          torch::mse_loss(model(x), y).backward();
        } else {
          torch::mse_loss(model(x), y).backward();
        }
      }
      opt.step();
    }
    if (c.inspect) c.inspect(rank, model);
    states[rank] = state_of(*net);
  });
  return states;
}

// Runs both and expects every rank's parameters (and rank 0's buffers) within `tol`.
template <typename Net>
void expect_parity(const ParityCase<Net>& c, std::vector<int64_t> x_shape, double tol = 1e-5) {
  torch::set_num_threads(1);
  const int rows = 4 * c.world;
  auto batches = make_batches(c.steps * c.accumulate, rows, std::move(x_shape), 3, 1234);
  if (c.adjust_batches) c.adjust_batches(batches);
  Net init_net = c.make();
  auto init = state_of(*init_net);
  auto want = train_reference(c, init, batches);
  auto got = train_ddp(c, init, batches);
  const size_t n_params = init_net->parameters().size();
  for (int r = 0; r < c.world; ++r) {
    std::vector<torch::Tensor> a(want.begin(), want.begin() + n_params);
    std::vector<torch::Tensor> b(got[r].begin(), got[r].begin() + n_params);
    EXPECT_LE(max_abs_diff(a, b), tol) << "parameters of rank " << r;
  }
  EXPECT_LE(max_abs_diff(want, got[0]), tol) << "parameters and buffers of rank 0";
  // Training moved the parameters (the comparison is not between two untouched copies).
  std::vector<torch::Tensor> init_params(init.begin(), init.begin() + n_params);
  std::vector<torch::Tensor> want_params(want.begin(), want.begin() + n_params);
  EXPECT_GT(max_abs_diff(init_params, want_params), 1e-3);
}

}  // namespace tdist::test
