// Memory: what a rank holds, measured, not computed from the model: from the tensors themselves
// (their storages' bytes) for parameters + gradients + Adam state against DDP's, and the
// gathered parameters held after forward with reshard_after_forward on and off; and from the
// allocator (core/cpu_memory.h's counting CPU allocator, in rank processes) for everything a
// rank holds between steps and at its peak.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <regex>
#include <unordered_set>

#include "tdist/core/cpu_memory.h"
#include "tdist/core/error.h"
#include "tdist/core/prefix_store.h"
#include "tdist/ddp/distributed_data_parallel.h"
#include "tdist/fsdp/detail/param_group.h"
#include "tests/fsdp/fsdp_test_util.h"

namespace tdist::test {
namespace {

// Adds the bytes of t's storage once per storage.
void count(const torch::Tensor& t, std::unordered_set<const void*>& seen, size_t& bytes) {
  if (!t.defined()) return;
  const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (seen.insert(s).second) bytes += s->nbytes();
}

// Parameters, their gradients and Adam's state tensors.
size_t held_bytes(const std::vector<torch::Tensor>& params, torch::optim::Adam& opt) {
  std::unordered_set<const void*> seen;
  size_t bytes = 0;
  for (const auto& p : params) {
    count(p, seen, bytes);
    count(p.grad(), seen, bytes);
  }
  for (const auto& [key, state] : opt.state()) {
    auto& s = static_cast<torch::optim::AdamParamState&>(*state);
    count(s.exp_avg(), seen, bytes);
    count(s.exp_avg_sq(), seen, bytes);
    count(s.max_exp_avg_sq(), seen, bytes);
  }
  return bytes;
}

// shard_size 0: FSDP over the world; else HSDP, which keeps 1/shard_size.
void expect_sharded_memory(int world, int shard_size = 0) {
  std::vector<size_t> fsdp_bytes(world), ddp_bytes(world);
  spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = make_group(store, rank, world);
    auto batches = make_batches(2, 2 * world, 3);
    Net a;
    fsdp::FSDPOptions opts;
    opts.shard_size = shard_size;
    auto model = fsdp::fully_shard(a, units_of(a), pg, opts);
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(kLr));
    Net b;
    ddp::DistributedDataParallel<Net> reference(b, pg);
    torch::optim::Adam ref_opt(reference.parameters(), torch::optim::AdamOptions(kLr));
    for (const auto& batch : batches) step_both(model, opt, reference, ref_opt, batch, rank, world);
    // What FSDP holds: the shards, their gradients and state, and the module's own parameters
    // (empty between steps) with their gradients (freed after the reduce-scatter).
    std::vector<torch::Tensor> all = model.parameters();
    for (const auto& p : a->parameters()) {
      EXPECT_EQ(p.numel(), 0) << "a module parameter kept its values between steps";
      all.push_back(p);
    }
    fsdp_bytes[rank] = held_bytes(all, opt) + model.unsharded_bytes();
    ddp_bytes[rank] = held_bytes(reference.parameters(), ref_opt);
  });
  // 16 bytes per parameter with Adam in fp32 (4 value, 4 gradient, 8 state).
  Net probe;
  size_t numel = 0;
  for (const auto& p : probe->parameters()) numel += p.numel();
  const size_t n = shard_size > 0 ? shard_size : world;
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(ddp_bytes[r], 16 * numel) << "rank " << r;
    const double ratio = double(fsdp_bytes[r]) / double(ddp_bytes[r]);
    // 1/N, plus the padding of each group to a multiple of N (at most N-1 elements of 4 groups).
    EXPECT_GT(ratio, 1.0 / n - 1e-9) << "rank " << r;
    EXPECT_LE(fsdp_bytes[r], 16 * ((numel + n - 1) / n + 4)) << "rank " << r;
    std::cout << "world " << world << " shard " << n << " rank " << r << ": fsdp " << fsdp_bytes[r]
              << " bytes, ddp " << ddp_bytes[r] << " bytes (" << ratio << ")\n";
  }
}

TEST(FSDPMemory, ParametersGradientsAndAdamStateTakeOneNthOfDDPsWorld2) {
  expect_sharded_memory(2);
}
TEST(FSDPMemory, ParametersGradientsAndAdamStateTakeOneNthOfDDPsWorld3) {
  expect_sharded_memory(3);
}

// World 4: 0.255 of DDP's for this model (the issue asks for at most 0.3; the bound checked is
// 1/4 plus padding).
TEST(FSDPMemory, ParametersGradientsAndAdamStateTakeOneNthOfDDPsWorld4) {
  expect_sharded_memory(4);
}
// HSDP keeps one shard of its shard group's size: 2x2 at world 4 holds half of DDP's.
TEST(FSDPMemory, HybridSharding2x2TakesHalfOfDDPsWorld4) { expect_sharded_memory(4, 2); }

// After forward, before backward: with reshard_after_forward only the root's own group is
// still gathered; without it every unit is too. After backward nothing is.
TEST(FSDPMemory, ReshardAfterForwardFreesEachUnit) {
  for (bool reshard : {true, false}) {
    const int world = 2;
    spawn(world, [&](int rank, std::shared_ptr<Store> store) {
      auto pg = make_group(store, rank, world);
      Net net;
      fsdp::FSDPOptions opts;
      opts.reshard_after_forward = reshard;
      auto model = fsdp::fully_shard(net, units_of(net), pg, opts);
      auto& st = model.state();
      ASSERT_EQ(st.num_groups(), 4u);  // fc1, mid, fc3, the root's `scale`
      size_t root_bytes = 0, all_bytes = 0;
      for (size_t g = 0; g < st.num_groups(); ++g) {
        const size_t b = st.group(g).padded_numel() * sizeof(float);
        all_bytes += b;
        if (st.group(g).name() == "(root)") root_bytes = b;
      }
      EXPECT_EQ(root_bytes, 4 * sizeof(float));  // 3 padded to 4
      EXPECT_EQ(model.unsharded_bytes(), 0u);
      auto out = model(torch::randn({2, 6}));
      EXPECT_EQ(model.unsharded_bytes(), reshard ? root_bytes : all_bytes)
          << "reshard_after_forward=" << reshard << " rank " << rank;
      EXPECT_EQ(net->fc1->weight.numel(), reshard ? 0 : 42);
      out.sum().backward();
      EXPECT_EQ(model.unsharded_bytes(), 0u);
      EXPECT_EQ(net->fc1->weight.numel(), 0);
      EXPECT_FALSE(net->fc1->weight.grad().defined()) << "the full gradient was not freed";
      // Without autograd nothing waits for a backward: every group is freed after forward.
      torch::NoGradGuard no_grad;
      model(torch::randn({2, 6}));
      EXPECT_EQ(model.unsharded_bytes(), 0u);
    });
  }
}

// Four units of Linear(256, 256) (263,168 parameters, 4.2 MB with Adam in fp32): large enough
// that the shards, not the allocator's small change, decide what a rank holds.
struct WideImpl : torch::nn::Module {
  WideImpl() {
    for (int i = 0; i < 4; ++i) {
      layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(256, 256)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = torch::tanh(fsdp::call(l, x));
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(Wide);

// One rank: the bytes of CPU tensors held after three Adam steps (nothing of a step alive) and
// at most during them, each less what was held before the model was built; first for fully_shard,
// then (everything of it freed) for DDP with gradients as bucket views (its gradients are its
// buckets: DDP holds 16 bytes per parameter, as the issue counts it).
//
// Each measurement has a process group of its own, destroyed before the next one's baseline. A
// group's worker thread completes an operation's future and only then drops its own reference
// to it (and so to the result tensors); descheduled in between, it released fully_shard's last
// reduce-scattered gradient shard after that model was gone, during DDP's measurement, which
// then read 65,792 bytes (one shard) short of 16 bytes per parameter (3 of 13 runs under
// load). Destroying the group joins that thread, so every reference it held is gone
// before the next baseline is read.
TDIST_TEST_CHILD(fsdp_allocator_memory_child) {
  track_cpu_memory();
  torch::set_num_threads(1);
  auto rdzv = rendezvous("env://", -1, -1, std::chrono::seconds(30));
  comm::ProcessGroup::Options po;
  po.timeout = std::chrono::seconds(30);
  auto x = torch::randn({4, 256});
  // train(net, pg, record): record() runs after the steps, while the model and optimizer live.
  using Record = std::function<void()>;
  using Train = std::function<void(Wide&, std::shared_ptr<comm::ProcessGroup>, const Record&)>;
  auto measure = [&](const Train& train, const char* name) {
    std::weak_ptr<comm::ProcessGroup> gone;
    {
      auto pg = comm::create_process_group(std::make_shared<PrefixStore>(name, rdzv.store),
                                           rdzv.rank, rdzv.world_size, po);
      gone = pg;
      const int64_t before = cpu_memory_stats().allocated_bytes;
      reset_peak_cpu_memory();
      torch::manual_seed(0);
      Wide net;
      train(net, std::move(pg), [&] {
        const CpuMemoryStats s = cpu_memory_stats();
        std::cout << "MEMORY " << name << " " << s.allocated_bytes - before << " "
                  << s.peak_bytes - before << std::endl;
      });
    }
    TDIST_CHECK(gone.expired(), name,
                ": something still holds its process group, whose "
                "worker may still hold the last operation's tensors");
  };
  // Three Adam steps of either wrapper, then record() while the optimizer (and its state) lives.
  auto adam_steps = [&](auto& model, const Record& record) {
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(kLr));
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      model(x).square().mean().backward();
      opt.step();
    }
    record();
  };
  measure(
      [&](Wide& net, std::shared_ptr<comm::ProcessGroup> pg, const Record& record) {
        std::vector<std::shared_ptr<torch::nn::Module>> units;
        for (auto& l : net->layers) units.push_back(l.ptr());
        auto model = fsdp::fully_shard(net, units, std::move(pg));
        adam_steps(model, record);
      },
      "fsdp");
  measure(
      [&](Wide& net, std::shared_ptr<comm::ProcessGroup> pg, const Record& record) {
        ddp::DDPOptions opts;
        opts.gradient_as_bucket_view = true;
        ddp::DistributedDataParallel<Wide> model(net, std::move(pg), opts);
        adam_steps(model, record);
      },
      "ddp");
  return 0;
}

// The issue's bound: at world 4 what a rank holds for the model between steps (parameters,
// gradients, Adam state and whatever else fully_shard keeps) is at most 0.3 of DDP's, as the
// allocator counts it; and its peak during a step is below what DDP holds at rest.
TEST(FSDPMemory, AllocatorCountsAtMostThreeTenthsOfDDPsBytesPerRankWorld4) {
  const int world = 4;
  Processes procs("fsdp_allocator_memory_child", world,
                  {{"MASTER_ADDR", "127.0.0.1"},
                   {"MASTER_PORT", std::to_string(free_port())},
                   {"OMP_NUM_THREADS", "1"}});
  auto results = procs.wait_all(std::chrono::seconds(90));
  ASSERT_TRUE(Processes::failures(results).empty()) << Processes::failures(results);
  const int64_t numel = 4 * (256 * 256 + 256);
  const std::regex line(R"(MEMORY (\w+) (-?\d+) (-?\d+))");
  for (const auto& r : results) {
    std::map<std::string, std::pair<int64_t, int64_t>> m;  // name: held after, peak
    for (std::sregex_iterator it(r.output.begin(), r.output.end(), line), end; it != end; ++it) {
      m[(*it)[1]] = {std::stoll((*it)[2]), std::stoll((*it)[3])};
    }
    ASSERT_EQ(m.size(), 2u) << r.output;
    const auto [fsdp_held, fsdp_peak] = m["fsdp"];
    const auto [ddp_held, ddp_peak] = m["ddp"];
    std::cout << "rank " << r.rank << ": fsdp holds " << fsdp_held << " bytes (peak " << fsdp_peak
              << "), ddp " << ddp_held << " (peak " << ddp_peak
              << "): " << double(fsdp_held) / double(ddp_held) << " of DDP's\n";
    // The counts see what they must: DDP's 16 bytes per parameter, fully_shard's quarter.
    EXPECT_GE(ddp_held, 16 * numel) << "rank " << r.rank;
    EXPECT_GE(fsdp_held, 16 * numel / world) << "rank " << r.rank;
    EXPECT_LE(double(fsdp_held), 0.3 * double(ddp_held)) << "rank " << r.rank;
    EXPECT_LT(fsdp_peak, ddp_held) << "rank " << r.rank;
  }
}

}  // namespace
}  // namespace tdist::test
