// ZeroRedundancyOptimizer (ZeRO-1) under tdist's DDP: the parameters after 20 Adam steps equal
// those of DDP with an unsharded Adam on every rank; each rank's optimizer state, measured from
// its tensors, is its partition's (about 1/N); bad input and a killed peer are errors.
#include <signal.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <iostream>

#include "tdist/core/rendezvous.h"
#include "tdist/ddp/distributed_data_parallel.h"
#include "tdist/fsdp/zero_redundancy_optimizer.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/harness/net.h"
#include "tests/harness/process.h"

namespace tdist::test {
namespace {

fsdp::ZeroRedundancyOptimizer::OptimizerFactory adam_factory() {
  return [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adam>(std::move(p), torch::optim::AdamOptions(kLr));
  };
}

void expect_zero_matches_ddp(int world) {
  std::vector<double> diffs(world, -1);
  std::vector<size_t> zero_state(world), ddp_state(world);
  std::vector<std::vector<int64_t>> partitions(world);
  spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = make_group(store, rank, world);
    auto batches = make_batches(20, 2 * world, 11);
    torch::manual_seed(5);
    Net a;
    auto init = values_of(*a);
    Net b;
    load_values(*b, init);
    ddp::DistributedDataParallel<Net> zero_model(a, pg);
    fsdp::ZeroRedundancyOptimizer opt(zero_model.parameters(), adam_factory(), pg);
    ddp::DistributedDataParallel<Net> ref_model(b, pg);
    torch::optim::Adam ref_opt(ref_model.parameters(), torch::optim::AdamOptions(kLr));
    for (const auto& batch : batches) {
      const auto x = rows_of(batch.x, rank, world);
      const auto y = rows_of(batch.y, rank, world);
      opt.zero_grad();
      torch::mse_loss(zero_model(x), y).backward();
      opt.step();
      ref_opt.zero_grad();
      torch::mse_loss(ref_model(x), y).backward();
      ref_opt.step();
    }
    diffs[rank] = max_abs_diff(values_of(*a), values_of(*b));
    zero_state[rank] = opt.local_state_bytes();
    ddp_state[rank] = fsdp::optimizer_state_bytes(ref_opt);
    partitions[rank] = opt.partition_numel();
  });
  Net probe;
  int64_t numel = 0, largest = 0;
  for (const auto& p : probe->parameters()) {
    numel += p.numel();
    largest = std::max<int64_t>(largest, p.numel());
  }
  size_t zero_total = 0;
  for (int r = 0; r < world; ++r) {
    EXPECT_LE(diffs[r], 1e-5) << "rank " << r;
    EXPECT_GE(diffs[r], 0) << "rank " << r << " did not run";
    EXPECT_EQ(partitions[r], partitions[0]) << "ranks disagree on the partition";
    // Adam: exp_avg and exp_avg_sq of the owned parameters, fp32.
    EXPECT_EQ(ddp_state[r], 8 * size_t(numel));
    EXPECT_EQ(zero_state[r], 8 * size_t(partitions[0][r])) << "rank " << r;
    // Greedy balance: no partition exceeds an even share by more than one parameter.
    EXPECT_LE(partitions[0][r], numel / world + largest) << "rank " << r;
    EXPECT_GT(zero_state[r], 0u) << "rank " << r << " owns nothing";
    zero_total += zero_state[r];
    std::cout << "world " << world << " rank " << r << ": optimizer state " << zero_state[r]
              << " bytes, DDP's " << ddp_state[r] << " ("
              << double(zero_state[r]) / double(ddp_state[r]) << "), max |diff| " << diffs[r]
              << "\n";
  }
  EXPECT_EQ(zero_total, ddp_state[0]) << "the partitions do not cover the model once";
}

TEST(ZeroRedundancyOptimizer, TwentyAdamStepsEqualDDPsWorld2) { expect_zero_matches_ddp(2); }
TEST(ZeroRedundancyOptimizer, TwentyAdamStepsEqualDDPsWorld3) { expect_zero_matches_ddp(3); }
TEST(ZeroRedundancyOptimizer, TwentyAdamStepsEqualDDPsWorld4) { expect_zero_matches_ddp(4); }

// More ranks than parameters: the ranks that own none take part in every broadcast and end
// equal to the others.
TEST(ZeroRedundancyOptimizer, RanksThatOwnNothingStillFollow) {
  const int world = 3;
  std::vector<torch::Tensor> finals(world);
  spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = make_group(store, rank, world);
    torch::manual_seed(1);
    auto w = torch::randn({5}).requires_grad_();
    fsdp::ZeroRedundancyOptimizer opt({w}, adam_factory(), pg);
    EXPECT_EQ(opt.owner(0), 0);
    EXPECT_EQ(opt.local_optimizer() != nullptr, rank == 0);
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      (w * w).sum().backward();
      opt.step();
    }
    finals[rank] = w.detach().clone();
  });
  for (int r = 1; r < world; ++r) EXPECT_TRUE(finals[r].equal(finals[0])) << "rank " << r;
}

TEST(ZeroRedundancyOptimizer, BadInputIsAClearError) {
  auto expect_error = [](std::function<void(std::shared_ptr<comm::ProcessGroup>)> fn,
                         const std::string& message) {
    spawn(2, [&](int rank, std::shared_ptr<Store> store) {
      auto pg = make_group(store, rank, 2);
      try {
        fn(pg);
        ADD_FAILURE() << "no error; expected '" << message << "'";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
      }
    });
  };
  auto w = [] { return torch::zeros({4}).requires_grad_(); };
  expect_error([&](auto pg) { fsdp::ZeroRedundancyOptimizer({}, adam_factory(), pg); },
               "no parameters");
  expect_error([&](auto pg) { fsdp::ZeroRedundancyOptimizer({w()}, nullptr, pg); },
               "factory is empty");
  expect_error(
      [&](auto pg) {
        auto t = w();
        fsdp::ZeroRedundancyOptimizer({t, t}, adam_factory(), pg);
      },
      "parameter 1 is given twice");
  expect_error(
      [&](auto pg) {
        fsdp::ZeroRedundancyOptimizer({torch::zeros({3}, torch::kLong)}, adam_factory(), pg);
      },
      "not floating point");
  expect_error(
      [&](auto pg) {
        fsdp::ZeroRedundancyOptimizer({w(), torch::zeros({2}, torch::kDouble)}, adam_factory(), pg);
      },
      "one dtype and device");
  // Ranks that pass different shapes are all told so (a collective check).
  expect_error(
      [&](auto pg) {
        fsdp::ZeroRedundancyOptimizer({torch::zeros({pg->rank() + 1})}, adam_factory(), pg);
      },
      "the ranks passed different parameters");
  expect_error(
      [&](auto pg) {  // two parameters: each rank owns one and calls the factory
        fsdp::ZeroRedundancyOptimizer(
            {w(), w()},
            [](std::vector<torch::Tensor>) { return std::unique_ptr<torch::optim::Optimizer>(); },
            pg);
      },
      "returned null");
}

// Note [ZeRO-1] 5's bad input: a rank outside the group (every rank), no optimizer or one over
// other parameters on the receiving rank (after the collectives: the other rank returns), and
// on load an optimizer over other parameters or of another kind.
TEST(ZeroRedundancyOptimizer, BadStateDictInputIsAClearError) {
  spawn(2, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = make_group(store, rank, 2);
    auto a = torch::zeros({4}).requires_grad_(), b = torch::zeros({3}).requires_grad_();
    fsdp::ZeroRedundancyOptimizer opt({a, b}, adam_factory(), pg);
    auto expect_arg = [&](const std::function<void()>& fn, const std::string& message) {
      try {
        fn();
        ADD_FAILURE() << "rank " << rank << ": no error; expected '" << message << "'";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
      }
    };
    expect_arg([&] { opt.consolidate_state_dict(nullptr, 2); }, "rank 2 is not in [0, 2)");
    torch::optim::Adam other({torch::zeros({4})});
    if (rank == 0) {
      expect_arg([&] { opt.consolidate_state_dict(nullptr, 0); }, "needs an optimizer");
      expect_arg([&] { opt.consolidate_state_dict(&other, 0); }, "holds 1 parameters, not the 2");
    } else {
      opt.consolidate_state_dict(nullptr, 0);
      opt.consolidate_state_dict(nullptr, 0);
    }
    expect_arg([&] { opt.load_state_dict(other); }, "holds 1 parameters, not the 2");
    torch::optim::SGD sgd({a, b}, torch::optim::SGDOptions(0.1));
    expect_arg([&] { opt.load_state_dict(sgd); }, "the factory's kind");
  });
}

// Rank 2 is SIGKILLed before its 3rd step's broadcasts; the survivors' step() fails with the
// broadcast's error within the timeout instead of hanging. Exit 3 with the error.
TDIST_TEST_CHILD(zero_peer_killed_child) {
  torch::set_num_threads(1);
  auto pg = env_process_group(std::chrono::seconds(10));
  Net net;
  ddp::DistributedDataParallel<Net> model(net, pg);
  fsdp::ZeroRedundancyOptimizer opt(model.parameters(), adam_factory(), pg);
  int step = 0;
  try {
    for (step = 0; step < 5; ++step) {
      opt.zero_grad();
      torch::mse_loss(model(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
      if (rank == 2 && step == 2) ::raise(SIGKILL);
      opt.step();
    }
  } catch (const std::exception& e) {
    std::cout << "ZERO ERROR at step " << step << ": " << e.what() << std::endl;
    return 3;
  }
  return 0;
}

TEST(ZeroRedundancyOptimizer, PeerKilledBeforeItsBroadcastIsAnErrorNotAHang) {
  auto results = expect_survivors_fail("zero_peer_killed_child", 3, 2, "ZERO ERROR at step 2");
  ASSERT_EQ(results.size(), 3u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(results[r].output.find("broadcast"), std::string::npos) << results[r].output;
  }
}

}  // namespace
}  // namespace tdist::test
