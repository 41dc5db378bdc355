// Nothing left behind by DDP: a DistributedDataParallel over the real process group (comm's ring
// group, shared memory and TCP between its two ranks, ranks as threads), trained for a few
// iterations and destroyed with its group, gracefully or after a rank aborted the group, leaves
// this process with the threads, descriptors, /dev/shm/tdist-* files and tdist-* mappings it held
// after the first round (which warms up what lives for the whole process). Counted from /proc as
// comm's Leaks.* do (tests/harness/proc_counts.h).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"
#include "tdist/ddp/comm_hooks.h"
#include "tests/ddp/ddp_test_util.h"
#include "tests/harness/proc_counts.h"
#include "tests/harness/spawn.h"

namespace tdist::test {
namespace {

using ddp::DDPOptions;
using ddp::DistributedDataParallel;

enum class Round { kGraceful, kPowerSGD, kAbort };

void train_step(DistributedDataParallel<MLP>& model, torch::optim::SGD& opt) {
  opt.zero_grad();
  torch::mse_loss(model(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
  opt.step();
}

// One group of 2 with DDP on it (several buckets), trained for 3 iterations, then destroyed.
// kPowerSGD: with the PowerSGD hook (a worker thread of its own), compressing from iteration 1.
// kAbort: then rank 1 aborts the group while rank 0 trains on, whose iteration must fail.
void one_round(Round round) {
  spawn(2, [&](int rank, std::shared_ptr<Store> store) {
    torch::set_num_threads(1);
    comm::ProcessGroup::Options po;
    po.timeout = std::chrono::seconds(30);
    auto pg = comm::create_process_group(store, rank, 2, po);
    {
      MLP net;
      DDPOptions opts;
      opts.bucket_cap_mb = 1e-6;
      opts.first_bucket_cap_mb = 1e-6;
      DistributedDataParallel<MLP> model(net, pg, opts);
      if (round == Round::kPowerSGD) {
        ddp::PowerSGDOptions p;
        p.start_powerSGD_iter = 1;
        model.register_comm_hook(ddp::powersgd_hook(p));
      }
      torch::optim::SGD opt(model.parameters(), 0.1);
      for (int i = 0; i < 3; ++i) train_step(model, opt);
      // What the counters must see come and go: the ranks' rings are mapped now.
      EXPECT_GT(held().shm_maps, 0) << "the group does not use shared memory: nothing is checked";
      if (round == Round::kAbort) {
        if (rank == 1) {
          pg->abort();
        } else {
          EXPECT_THROW(train_step(model, opt), ::tdist::Error);
        }
      } else {
        pg->barrier()->wait();
      }
    }
    pg.reset();
  });
}

void expect_nothing_left(Round round) {
  expect_rounds_leave_nothing([&] { one_round(round); });
}

TEST(DDPLeaks, DDPDestroyedWithItsGroupLeavesNoThreadDescriptorOrSegment) {
  expect_nothing_left(Round::kGraceful);
}

TEST(DDPLeaks, DDPWithThePowerSGDHookLeavesNoThreadDescriptorOrSegment) {
  expect_nothing_left(Round::kPowerSGD);
}

TEST(DDPLeaks, DDPOnAnAbortedGroupLeavesNoThreadDescriptorOrSegment) {
  expect_nothing_left(Round::kAbort);
}

}  // namespace
}  // namespace tdist::test
