// DDP over the real process group (comm's ring backend over TCP on 127.0.0.1): parity with ranks
// as threads, and, with ranks as processes, a peer killed during backward and buckets in
// symmetric memory.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/comm/process_group.h"
#include "tdist/comm/ring/ring_process_group.h"
#include "tdist/core/env.h"
#include "tdist/core/hash_store.h"
#include "tdist/core/rendezvous.h"
#include "tests/ddp/ddp_test_util.h"
#include "tests/harness/proc_counts.h"
#include "tests/harness/process.h"
#include "tests/harness/spawn.h"
#include "tests/harness/net.h"

namespace tdist::test {
namespace {

using ddp::DDPOptions;
using ddp::DistributedDataParallel;

// Parity of an MLP and a conv net over the ring group, ranks as threads sharing a HashStore.
template <typename Net>
void expect_real_parity(std::function<Net()> make, std::vector<int64_t> x_shape, int world,
                        DDPOptions opts = {}) {
  torch::set_num_threads(1);
  ParityCase<Net> c;
  c.make = make;
  c.world = world;
  c.opts = opts;
  auto batches = make_batches(c.steps, 4 * world, x_shape, 3, 99);
  Net init_net = make();
  auto init = state_of(*init_net);
  auto want = train_reference(c, init, batches);
  std::vector<std::vector<torch::Tensor>> got(world);
  spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    comm::ProcessGroup::Options po;
    po.timeout = std::chrono::seconds(30);
    auto pg = comm::create_process_group(store, rank, world, po);
    Net net = make();
    if (rank == 0) load_state(*net, init);
    DistributedDataParallel<Net> model(net, pg, c.opts);
    torch::optim::SGD opt(model.parameters(), c.lr);
    for (int s = 0; s < c.steps; ++s) {
      opt.zero_grad();
      torch::mse_loss(model(shard(batches[s].x, rank, world)), shard(batches[s].y, rank, world))
          .backward();
      opt.step();
    }
    got[rank] = state_of(*net);
  });
  for (int r = 0; r < world; ++r) EXPECT_LE(max_abs_diff(want, got[r]), 1e-5) << "rank " << r;
}

TEST(DDPRealGroup, MLPParityWorld2) {
  expect_real_parity<MLP>([] { return MLP(); }, {6}, 2);
}

TEST(DDPRealGroup, MLPParityWorld3ManyBuckets) {
  DDPOptions o;
  o.bucket_cap_mb = 1e-6;
  expect_real_parity<MLP>([] { return MLP(); }, {6}, 3, o);
}

TEST(DDPRealGroup, ConvNetParityWorld2) {
  expect_real_parity<ConvNet>([] { return ConvNet(); }, {1, 8, 8}, 2);
}

// Rank 1 kills itself (SIGKILL) in the middle of its 3rd backward; rank 0 must get an error from
// its backward (not hang) and exits with code 3 after printing it.
TDIST_TEST_CHILD(ddp_peer_killed_child) {
  torch::set_num_threads(1);
  auto rdzv = rendezvous("env://", -1, -1, std::chrono::seconds(30));
  comm::ProcessGroup::Options po;
  po.timeout = std::chrono::seconds(10);
  auto pg = comm::create_process_group(rdzv.store, rdzv.rank, rdzv.world_size, po);
  MLP net;
  DDPOptions opts;
  opts.bucket_cap_mb = 1e-6;  // several buckets: some go out before the kill
  DistributedDataParallel<MLP> model(net, pg, opts);
  int iteration = 0;
  if (rank == 1) {
    // fc1.weight's gradient comes last: by then earlier buckets were launched.
    net->fc1->weight.register_hook([&](torch::Tensor g) {
      if (iteration == 2) ::raise(SIGKILL);
      return g;
    });
  }
  torch::optim::SGD opt(model.parameters(), 0.1);
  try {
    for (iteration = 0; iteration < 5; ++iteration) {
      opt.zero_grad();
      torch::mse_loss(model(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
      opt.step();
    }
  } catch (const std::exception& e) {
    std::cout << "DDP ERROR at iteration " << iteration << ": " << e.what() << std::endl;
    return 3;
  }
  return 0;
}

TEST(DDPRealGroup, PeerKilledDuringBackwardIsAnErrorNotAHang) {
  Processes procs("ddp_peer_killed_child", 2,
                  {{"MASTER_ADDR", "127.0.0.1"},
                   {"MASTER_PORT", std::to_string(free_port())},
                   {"OMP_NUM_THREADS", "1"}});
  auto results = procs.wait_all(std::chrono::seconds(90));
  ASSERT_EQ(results.size(), 2u);
  std::cout << "rank 0's output:\n" << results[0].output;
  EXPECT_FALSE(results[1].exited) << results[1].describe() << "\n" << results[1].output;
  EXPECT_EQ(results[1].signal, SIGKILL) << results[1].describe();
  EXPECT_FALSE(results[0].timed_out) << "rank 0 hung:\n" << results[0].output;
  EXPECT_TRUE(results[0].exited && results[0].exit_code == 3) << results[0].describe() << "\n"
                                                              << results[0].output;
  EXPECT_NE(results[0].output.find("DDP ERROR at iteration 2"), std::string::npos)
      << results[0].output;
  EXPECT_NE(results[0].output.find("bucket"), std::string::npos) << results[0].output;
}

// DDP's CPU buckets in symmetric memory (Note [DDP bucketing] 12), ranks as processes, by
// default and with gradient_as_bucket_view (TDIST_TEST_VIEWS=1): each backward reduces its one
// bucket (fc2's 256 KiB and the rest) by reading the peer's bucket where it lies, every .grad is
// a view of it, the gradients are the average of the ranks' own (a plain copy of the model
// computes every rank's), before and after the rebuild of the second forward; and the process
// maps one bucket read-write and the peer's read-only. Exit code: the number of mismatches, each
// printed.
TDIST_TEST_CHILD(ddp_symmetric_child) {
  torch::set_num_threads(1);
  auto rdzv = rendezvous("env://", -1, -1, std::chrono::seconds(30));
  auto pg = comm::create_process_group(rdzv.store, rdzv.rank, rdzv.world_size);
  auto* ring = dynamic_cast<comm::detail::RingProcessGroup*>(pg.get());
  if (ring == nullptr) return 30;
  auto make = [] {
    torch::manual_seed(7);
    return MLP(16, 256, 4);
  };
  auto data = [](int64_t seed) {
    auto g = at::detail::createCPUGenerator(100 + seed);
    return std::make_pair(at::randn({8, 16}, g), at::randn({8, 4}, g));
  };
  MLP net = make();
  DDPOptions opts;
  opts.gradient_as_bucket_view = env::get("TDIST_TEST_VIEWS").value_or("0") == "1";
  DistributedDataParallel<MLP> model(net, pg, opts);
  int bad = 0;
  auto check = [&](bool ok, const std::string& what) {
    if (!ok) {
      std::cerr << "rank " << rank << ": " << what << std::endl;
      ++bad;
    }
  };
  for (int step = 0; step < 3; ++step) {
    for (auto& p : model.parameters()) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    auto [x, y] = data(step * world_size + rank);
    torch::mse_loss(model(x), y).backward();
    const auto c = ring->last_counts();
    check(c.forwards == 0 && c.sends == 3 && c.bytes_sent < 64,
          str("step ", step, ": the bucket went through the channels (", c.bytes_sent, " bytes)"));
    MLP ref = make();
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < ref->parameters().size(); ++i) {
        ref->parameters()[i].copy_(net->parameters()[i]);
      }
    }
    for (int r = 0; r < world_size; ++r) {
      auto [rx, ry] = data(step * world_size + r);
      (torch::mse_loss(ref(rx), ry) / world_size).backward();
    }
    for (size_t i = 0; i < ref->parameters().size(); ++i) {
      const at::Tensor& grad = net->parameters()[i].grad();
      check(torch::allclose(grad, ref->parameters()[i].grad(), 1e-5, 1e-6),
            str("step ", step, ": gradient ", i, " is not the ranks' average"));
      check(ring->is_symmetric(grad),
            str("step ", step, ": gradient ", i, " is not in the bucket"));
    }
    const auto [rw, ro] = symmetric_mappings();
    check(rw == 1 && ro == world_size - 1,
          str("step ", step, ": ", rw, " read-write and ", ro, " read-only symmetric mappings"));
    torch::NoGradGuard no_grad;
    for (auto& p : model.parameters()) p.sub_(p.grad() * 0.1);
  }
  return bad;
}

TEST(DDPRealGroup, SymmetricBucketsAreReducedWhereTheyLie) {
  for (const char* views : {"0", "1"}) {
    SCOPED_TRACE(str("gradient_as_bucket_view ", views));
    Processes procs("ddp_symmetric_child", 2,
                    {{"MASTER_ADDR", "127.0.0.1"},
                     {"MASTER_PORT", std::to_string(free_port())},
                     {"TDIST_TRANSPORT", "auto"},
                     {"TDIST_TEST_VIEWS", views},
                     {"OMP_NUM_THREADS", "1"}});
    auto results = procs.wait_all(std::chrono::seconds(90));
    EXPECT_EQ(Processes::failures(results), "");
  }
}

}  // namespace
}  // namespace tdist::test
