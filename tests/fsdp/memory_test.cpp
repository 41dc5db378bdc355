// Memory: what a rank holds, measured from the tensors themselves (their storages' bytes), not
// computed from the model: parameters + gradients + Adam state against DDP's, and the gathered
// parameters held after forward with reshard_after_forward on and off.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unordered_set>

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

}  // namespace
}  // namespace tdist::test
