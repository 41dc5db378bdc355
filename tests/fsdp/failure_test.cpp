// A peer that dies mid-step, with ranks as real processes: the survivors' backward fails with
// the collective's error (naming the operation) within the timeout instead of hanging.
#include <signal.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>

#include "tdist/core/rendezvous.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/harness/net.h"
#include "tests/harness/process.h"

namespace tdist::test {
namespace {

// Five Adam steps of Net over a group of real processes (shard_size: FSDPOptions', 0 for the
// whole group); `victim` kills itself (SIGKILL) when the gradient of its 3rd step's output
// arrives, so the others are then in that backward, gathering a unit again, reduce-scattering or
// (HSDP) allreducing across replicas. Exit 3 with the error.
int train_until_rank_killed(int victim, int shard_size) {
  torch::set_num_threads(1);
  auto pg = env_process_group(std::chrono::seconds(10));
  Net net;
  fsdp::FSDPOptions opts;
  opts.shard_size = shard_size;
  auto model = fsdp::fully_shard(net, units_of(net), pg, opts);
  torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(kLr));
  int step = 0;
  try {
    for (step = 0; step < 5; ++step) {
      opt.zero_grad();
      auto out = model(torch::randn({4, 6}));
      if (pg->rank() == victim && step == 2) {
        out.register_hook([](torch::Tensor g) {
          ::raise(SIGKILL);
          return g;
        });
      }
      torch::mse_loss(out, torch::zeros({4, 3})).backward();
      opt.step();
    }
  } catch (const std::exception& e) {
    std::cout << "FSDP ERROR at step " << step << ": " << e.what() << std::endl;
    return 3;
  }
  return 0;
}

TDIST_TEST_CHILD(fsdp_peer_killed_child) { return train_until_rank_killed(2, 0); }

TEST(FSDPFailure, PeerKilledDuringBackwardIsAnErrorNotAHang) {
  auto results = expect_survivors_fail("fsdp_peer_killed_child", 3, 2, "FSDP ERROR at step 2");
  ASSERT_EQ(results.size(), 3u);
  for (int r = 0; r < 2; ++r) {
    const std::string& out = results[r].output;
    const bool named = out.find("allgather") != std::string::npos ||
                       out.find("reduce_scatter") != std::string::npos;
    EXPECT_TRUE(named) << out;
    // The peer it lost: rank 2, or a survivor that already exited with its own error.
    EXPECT_NE(out.find("lost rank"), std::string::npos) << out;
  }
  std::cout << "rank 0's output:\n" << results[0].output;
}

// HSDP 2x2 at world 4: rank 3 is killed, so rank 2 (its shard group) is in a reduce-scatter or
// gather with it and rank 1 (its replicate group) in an allreduce or about to be.
TDIST_TEST_CHILD(fsdp_hsdp_killed_child) { return train_until_rank_killed(3, 2); }

// A survivor's error in one of its two groups ends its step, and its process: so the failure
// reaches the rank that shares no group with the dead one too, each within the timeout. The
// errors come from the subgroups and name ranks as the subgroup numbers them ("lost rank 1" in
// {2, 3} is world rank 3).
TEST(FSDPFailure, RankKilledUnderHybridShardingFailsEverySurvivor) {
  auto results = expect_survivors_fail("fsdp_hsdp_killed_child", 4, 3, "FSDP ERROR at step 2");
  ASSERT_EQ(results.size(), 4u);
  for (int r = 0; r < 3; ++r) {
    const std::string& out = results[r].output;
    EXPECT_NE(out.find("lost rank"), std::string::npos) << out;
    const size_t at = out.find("FSDP ERROR");
    std::cout << "rank " << r << ": " << (at == std::string::npos ? out : out.substr(at));
  }
}

// Two units; the last rank kills itself (SIGKILL) between them in
// its 3rd forward, so the other ranks are in the second unit's allgather (prefetch off: issued
// when that unit runs) when it dies.
struct TwoUnitsImpl : torch::nn::Module {
  TwoUnitsImpl()
      : a(register_module("a", torch::nn::Linear(6, 5))),
        b(register_module("b", torch::nn::Linear(5, 3))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = fsdp::call(a, x);
    if (die) ::raise(SIGKILL);
    return fsdp::call(b, torch::relu(x));
  }
  torch::nn::Linear a, b;
  bool die = false;
};
TORCH_MODULE(TwoUnits);

TDIST_TEST_CHILD(fsdp_killed_in_allgather_child) {
  torch::set_num_threads(1);
  const int victim = world_size - 1;
  auto pg = env_process_group(std::chrono::seconds(10));
  TwoUnits net;
  fsdp::FSDPOptions opts;
  opts.prefetch = 0;
  auto model = fsdp::fully_shard(net, {net->a.ptr(), net->b.ptr()}, pg, opts);
  torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(kLr));
  int step = 0;
  try {
    for (step = 0; step < 5; ++step) {
      net->die = rank == victim && step == 2;
      opt.zero_grad();
      torch::mse_loss(model(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
      opt.step();
    }
  } catch (const std::exception& e) {
    std::cout << "FSDP ERROR at step " << step << ": " << e.what() << std::endl;
    return 3;
  }
  return 0;
}

// Every survivor's forward fails (within the group's 10 s timeout, never a hang) with the
// allgather's error; a survivor next to the dead rank names it, the others name the survivor
// whose abort closed their connection (the ring's chain) or rank 3 itself.
TEST(FSDPFailure, RankKilledDuringAnAllgatherFailsEverySurvivor) {
  for (int world : {3, 4}) {
    const int victim = world - 1;
    auto results = expect_survivors_fail("fsdp_killed_in_allgather_child", world, victim,
                                         "FSDP ERROR at step 2");
    ASSERT_EQ(static_cast<int>(results.size()), world);
    bool named = false;
    for (int r = 0; r < victim; ++r) {
      const std::string& out = results[r].output;
      EXPECT_NE(out.find("allgather"), std::string::npos) << out;
      EXPECT_NE(out.find("lost rank"), std::string::npos) << out;
      named = named || out.find("lost rank " + std::to_string(victim)) != std::string::npos;
      const size_t at = out.find("FSDP ERROR");
      std::cout << "world " << world << " rank " << r << ": "
                << (at == std::string::npos ? out : out.substr(at));
    }
    EXPECT_TRUE(named) << "no survivor named rank " << victim;
  }
}

}  // namespace
}  // namespace tdist::test
