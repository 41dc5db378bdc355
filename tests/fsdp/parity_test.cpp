// Parity: N FSDP ranks, each on its rows of the batch, end with the parameters of one process
// trained with Adam on the whole batch (and of tdist's DDP), within 1e-5 after 20 steps.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <optional>

#include "tdist/comm/device_mesh.h"
#include "tdist/ddp/distributed_data_parallel.h"
#include "tdist/fsdp/detail/param_group.h"
#include "tests/fsdp/fsdp_test_util.h"

namespace tdist::test {
namespace {

struct Case {
  int world = 2;
  bool reshard_after_forward = true;
  bool unused_steps = false;  // `mid.side` is left unused in odd steps
  bool nested = false;        // `mid.side` is a unit of its own inside the unit `mid`
  int steps = 20;
  bool sgd = false;  // SGD instead of Adam (see make_optimizer)
  int prefetch = 1;  // FSDPOptions::prefetch
  int micro = 1;     // backwards per step; all but the last under no_sync()
  double clip = 0;   // > 0: clip_grad_norm(clip, norm_type) before each step
  double norm_type = 2;
  int shard_size = 0;  // FSDPOptions::shard_size (HSDP)
};

const Batch& batch_of(const std::vector<Batch>& batches, const Case& c, int step, int m) {
  return batches[step * c.micro + m];
}

// One process, the whole batch, the same optimizer. zero_grad keeps gradients as zeros (not
// undefined) so that a parameter a step left unused is stepped with a zero gradient, as FSDP's
// flat shards are (Note [Sharded data parallel]); `side` is used in step 0, so it has a gradient
// from then. Micro-batches accumulate their gradients; `norms` gets each clipped norm.
std::vector<torch::Tensor> train_reference(const Case& c, const std::vector<torch::Tensor>& init,
                                           const std::vector<Batch>& batches,
                                           std::vector<double>* norms) {
  Net net;
  load_values(*net, init);
  auto opt = make_optimizer(net->parameters(), c.sgd);
  for (int s = 0; s < c.steps; ++s) {
    opt->zero_grad(/*set_to_none=*/false);
    for (int m = 0; m < c.micro; ++m) {
      const Batch& b = batch_of(batches, c, s, m);
      torch::mse_loss(net->forward(b.x, side_used(s, c.unused_steps)), b.y).backward();
    }
    if (c.clip > 0) {
      norms->push_back(torch::nn::utils::clip_grad_norm_(net->parameters(), c.clip, c.norm_type));
    }
    opt->step();
  }
  return values_of(*net);
}

// Each rank's full parameters (module order) after c.steps steps.
// Each rank's clipped norms go to norms[rank].
std::vector<std::vector<torch::Tensor>> train_fsdp(const Case& c,
                                                   const std::vector<torch::Tensor>& init,
                                                   const std::vector<Batch>& batches,
                                                   std::vector<std::vector<double>>& norms) {
  std::vector<std::vector<torch::Tensor>> got(c.world);
  norms.assign(c.world, {});
  spawn(c.world, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = make_group(store, rank, c.world);
    Net net;
    if (rank == 0) load_values(*net, init);  // the others get rank 0's by broadcast
    auto units = units_of(net);
    if (c.nested) units.insert(units.begin() + 1, net->mid->side.ptr());
    fsdp::FSDPOptions opts;
    opts.reshard_after_forward = c.reshard_after_forward;
    opts.prefetch = c.prefetch;
    opts.shard_size = c.shard_size;
    auto model = fsdp::fully_shard(net, units, pg, opts);
    auto opt = make_optimizer(model.parameters(), c.sgd);
    for (int s = 0; s < c.steps; ++s) {
      opt->zero_grad();
      for (int m = 0; m < c.micro; ++m) {
        const Batch& b = batch_of(batches, c, s, m);
        const bool last = m + 1 == c.micro;
        std::optional<fsdp::NoSyncGuard> no_sync;
        if (!last) no_sync.emplace(model.no_sync());
        const size_t reduced = model.counters().reduce_scatters;
        auto out = model(rows_of(b.x, rank, c.world), side_used(s, c.unused_steps));
        torch::mse_loss(out, rows_of(b.y, rank, c.world)).backward();
        EXPECT_EQ(model.unsharded_bytes(), 0u) << "rank " << rank << " step " << s;
        if (!last) {
          EXPECT_EQ(model.counters().reduce_scatters, reduced) << "a reduce-scatter under no_sync";
          EXPECT_TRUE(net->fc1->weight.grad().defined()) << "no_sync dropped a full gradient";
        }
      }
      EXPECT_FALSE(net->fc1->weight.grad().defined()) << "a full gradient outlived its step";
      for (const auto& p : model.parameters()) ASSERT_TRUE(p.grad().defined()) << "step " << s;
      if (c.clip > 0) norms[rank].push_back(model.clip_grad_norm(c.clip, c.norm_type));
      opt->step();
    }
    // Each unit's parameters are gathered once in forward and, resharded after it, once more in
    // backward; the root's once. Prefetching changes when, never how often.
    const size_t n_units = units.size();
    const size_t per_step = 1 + n_units * (c.reshard_after_forward ? 2 : 1);
    EXPECT_EQ(model.counters().allgathers, per_step * c.steps * c.micro);
    EXPECT_EQ(model.counters().reduce_scatters, (n_units + 1) * c.steps);
    if (c.prefetch > 0 && c.reshard_after_forward && !c.nested && !c.unused_steps) {
      // From the second iteration, when each backward's order is the forward's before, every
      // gather but the root's own is issued ahead: in forward from the root's forward on, in
      // backward from the root's backward on (the last unit's too).
      EXPECT_EQ(model.counters().prefetched, 2 * n_units * (c.steps * c.micro - 1));
    } else if (c.prefetch > 0 && c.steps > 1) {
      EXPECT_GT(model.counters().prefetched, 0u);
    } else {
      EXPECT_EQ(model.counters().prefetched, 0u);
    }
    got[rank] = full_values(model.full_parameters());
  });
  return got;
}

void expect_parity(const Case& c) {
  torch::manual_seed(7);
  Net init_net;
  auto init = values_of(*init_net);
  auto batches = make_batches(c.steps * c.micro, 4 * c.world, 99);
  std::vector<double> want_norms;
  auto want = train_reference(c, init, batches, &want_norms);
  std::vector<std::vector<double>> norms;
  auto got = train_fsdp(c, init, batches, norms);
  // Guards against a vacuous pass: training moved the parameters.
  EXPECT_GT(max_abs_diff(init, want), 1e-3);
  for (int r = 0; r < c.world; ++r) {
    EXPECT_LE(max_abs_diff(want, got[r]), 1e-5) << "rank " << r;
    ASSERT_EQ(norms[r].size(), want_norms.size());
    for (size_t s = 0; s < want_norms.size(); ++s) {
      EXPECT_NEAR(norms[r][s], want_norms[s], 1e-5 * want_norms[s])
          << "rank " << r << " step " << s;
    }
  }
  if (c.clip > 0) {  // clipping took effect
    EXPECT_GT(*std::max_element(want_norms.begin(), want_norms.end()), c.clip);
  }
}

// Adam, then SGD.
void expect_parity_both(Case c) {
  expect_parity(c);
  c.sgd = true;
  expect_parity(c);
}

TEST(FSDPParity, World1) { expect_parity_both({1, true}); }
TEST(FSDPParity, World2ReshardAfterForward) { expect_parity_both({2, true}); }
TEST(FSDPParity, World2KeepAfterForward) { expect_parity_both({2, false}); }
TEST(FSDPParity, World3ReshardAfterForward) { expect_parity_both({3, true}); }
TEST(FSDPParity, World3KeepAfterForward) { expect_parity_both({3, false}); }

TEST(FSDPParity, ParameterUnusedInSomeSteps) {
  expect_parity_both({2, true, /*unused_steps=*/true});
  expect_parity_both({3, false, /*unused_steps=*/true});
}

TEST(FSDPParity, NestedUnitTakesItsOwnParameters) {
  Case c{2, true};
  c.nested = true;
  expect_parity_both(c);
}

TEST(FSDPParity, PrefetchNoneOrTwoUnitsAhead) {
  for (int prefetch : {0, 2}) {
    Case c{3, true};
    c.prefetch = prefetch;
    expect_parity_both(c);
    c.reshard_after_forward = false;
    expect_parity_both(c);
  }
}

TEST(FSDPParity, GradientAccumulationUnderNoSync) {
  Case c{2, true};
  c.micro = 2;
  c.steps = 10;
  expect_parity_both(c);
  c.world = 3;
  c.micro = 3;
  c.reshard_after_forward = false;
  expect_parity_both(c);
}

TEST(FSDPParity, ClipGradNormUsesTheGlobalNorm) {
  Case c{3, true};
  c.clip = 0.05;
  c.steps = 10;
  expect_parity_both(c);
  c.world = 2;
  c.norm_type = std::numeric_limits<double>::infinity();
  c.clip = 0.02;
  expect_parity_both(c);
}

// A group whose inputs need no gradient (the root's, fed with data) and that has a parameter
// unused in odd steps: neither the accumulator hooks nor an input node see it complete, so its
// reduce-scatter is issued at the end of backward.
TEST(FSDPParity, GroupCompletedOnlyAtTheEndOfBackward) {
  const int world = 2;
  const int steps = 6;
  torch::manual_seed(3);
  Gated init_net(5);
  auto init = values_of(*init_net);
  std::vector<Batch> batches;
  for (int s = 0; s < steps; ++s) batches.push_back({torch::randn({4, 5}), torch::randn({4, 5})});
  Gated ref(5);
  load_values(*ref, init);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  for (int s = 0; s < steps; ++s) {
    ref_opt.zero_grad(/*set_to_none=*/false);
    torch::mse_loss(ref->forward(batches[s].x, s % 2 == 0), batches[s].y).backward();
    ref_opt.step();
  }
  auto want = values_of(*ref);
  std::vector<std::vector<torch::Tensor>> got(world);
  spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = make_group(store, rank, world);
    Gated net(5);
    load_values(*net, init);
    auto model = fsdp::fully_shard(net, {}, pg);  // one group: the root's
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      auto out = model(rows_of(batches[s].x, rank, world), s % 2 == 0);
      torch::mse_loss(out, rows_of(batches[s].y, rank, world)).backward();
      ASSERT_TRUE(model.parameters()[0].grad().defined()) << "step " << s;
      EXPECT_EQ(model.unsharded_bytes(), 0u);
      opt.step();
    }
    got[rank] = full_values(model.full_parameters());
  });
  EXPECT_GT(max_abs_diff(init, want), 1e-3);
  for (int r = 0; r < world; ++r) EXPECT_LE(max_abs_diff(want, got[r]), 1e-5) << "rank " << r;
}

// The oracle the issue names: tdist's DDP over the same group, same model, same Adam steps.
TEST(FSDPParity, MatchesTdistDDP) {
  const int world = 3;
  const int steps = 20;
  torch::manual_seed(11);
  Net init_net;
  auto init = values_of(*init_net);
  auto batches = make_batches(steps, 4 * world, 5);
  std::vector<std::vector<torch::Tensor>> fsdp_got(world), ddp_got(world);
  spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = make_group(store, rank, world);
    Net a;
    load_values(*a, init);
    auto model = fsdp::fully_shard(a, units_of(a), pg);
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(kLr));
    Net b;
    load_values(*b, init);
    ddp::DistributedDataParallel<Net> reference(b, pg);
    torch::optim::Adam ref_opt(reference.parameters(), torch::optim::AdamOptions(kLr));
    for (const auto& batch : batches) step_both(model, opt, reference, ref_opt, batch, rank, world);
    fsdp_got[rank] = full_values(model.full_parameters());
    ddp_got[rank] = values_of(*b);
  });
  EXPECT_GT(max_abs_diff(init, ddp_got[0]), 1e-3);
  for (int r = 0; r < world; ++r) {
    EXPECT_LE(max_abs_diff(ddp_got[r], fsdp_got[r]), 1e-5) << "rank " << r;
  }
}

TEST(FSDPParity, World4ReshardAfterForwardAndNot) {
  expect_parity_both({4, true});
  expect_parity_both({4, false, /*unused_steps=*/true});
}

// A language-model shape: the embedding's weight is also the output layer's (tied), used at the
// start and the end of forward; it lives in the root's group (FSDP2's rule for a parameter two
// modules share: the unit above both owns it), the blocks are units.
struct TiedImpl : torch::nn::Module {
  static constexpr int64_t kVocab = 11;
  TiedImpl()
      : emb(register_module("emb", torch::nn::Embedding(kVocab, 6))),
        b1(register_module("b1", torch::nn::Linear(6, 6))),
        b2(register_module("b2", torch::nn::Linear(6, 6))) {}
  torch::Tensor forward(torch::Tensor tokens) {
    auto h = emb(tokens);
    h = h + torch::tanh(fsdp::call(b1, h));
    h = h + torch::tanh(fsdp::call(b2, h));
    return torch::nn::functional::linear(h, emb->weight);  // the tied output layer
  }
  torch::nn::Embedding emb;
  torch::nn::Linear b1, b2;
};
TORCH_MODULE(Tied);

TEST(FSDPParity, TiedEmbeddingAndOutputMatchesTdistDDPAtWorlds3And4) {
  for (int world : {3, 4}) {
    const int steps = 20;
    torch::manual_seed(29);
    Tied init_net;
    auto init = values_of(*init_net);
    std::vector<Batch> batches;
    for (int s = 0; s < steps; ++s) {
      batches.push_back({torch::randint(0, TiedImpl::kVocab, {2 * world, 5}),
                         torch::randint(0, TiedImpl::kVocab, {2 * world, 5})});
    }
    std::vector<std::vector<torch::Tensor>> fsdp_got(world), ddp_got(world);
    spawn(world, [&](int rank, std::shared_ptr<Store> store) {
      auto pg = make_group(store, rank, world);
      Tied a;
      load_values(*a, init);
      auto model = fsdp::fully_shard(a, {a->b1.ptr(), a->b2.ptr()}, pg);
      torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(kLr));
      Tied b;
      load_values(*b, init);
      ddp::DistributedDataParallel<Tied> reference(b, pg);
      torch::optim::Adam ref_opt(reference.parameters(), torch::optim::AdamOptions(kLr));
      auto loss = [&](torch::Tensor logits, const torch::Tensor& y) {
        return torch::cross_entropy_loss(logits.reshape({-1, TiedImpl::kVocab}), y.reshape({-1}));
      };
      for (const auto& batch : batches) {
        const auto x = rows_of(batch.x, rank, world);
        const auto y = rows_of(batch.y, rank, world);
        opt.zero_grad();
        loss(model(x), y).backward();
        opt.step();
        ref_opt.zero_grad();
        loss(reference(x), y).backward();
        ref_opt.step();
      }
      fsdp_got[rank] = full_values(model.full_parameters());
      ddp_got[rank] = values_of(*b);
    });
    EXPECT_GT(max_abs_diff(init, ddp_got[0]), 1e-3);
    for (int r = 0; r < world; ++r) {
      EXPECT_LE(max_abs_diff(ddp_got[r], fsdp_got[r]), 1e-5) << "world " << world << " rank " << r;
    }
  }
}

// HSDP with the rest of the features: clipping with the global norm (summed over the shard group
// only), gradient accumulation, a parameter unused in some steps, prefetch; shard groups of 2
// and of 1 (every rank a replica: the allreduce does all the work).
TEST(FSDPParity, HybridShardingWithClippingAccumulationAndUnusedParameters) {
  Case c{4, true, /*unused_steps=*/true};
  c.shard_size = 2;
  c.clip = 0.05;
  c.steps = 10;
  expect_parity_both(c);
  c.clip = 0;
  c.micro = 2;
  c.shard_size = 1;
  c.reshard_after_forward = false;
  c.prefetch = 2;
  expect_parity_both(c);
}

// A mesh with a dimension FSDP does not use ({"pp", 2} beside {"shard", 2}, as a pipeline lays
// its world out): each stage's pair of ranks shards its own model on its own data, and equals
// tdist's DDP over that pair.
TEST(FSDPParity, MeshShardsAlongItsShardDimensionOnly) {
  const int world = 4;
  const int steps = 10;
  torch::manual_seed(31);
  Net init_net;
  auto init = values_of(*init_net);
  const std::vector<std::vector<Batch>> stage_batches = {make_batches(steps, 4, 37),
                                                         make_batches(steps, 4, 41)};
  std::vector<std::vector<torch::Tensor>> fsdp_got(world), ddp_got(world);
  spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = make_group(store, rank, world);
    comm::DeviceMesh mesh(pg, {{"pp", 2}, {"shard", 2}});
    const int stage = mesh.coordinate("pp");
    const int r = mesh.coordinate("shard");
    Net a;
    load_values(*a, init);
    auto model = fsdp::fully_shard(a, units_of(a), mesh);
    EXPECT_EQ(model.process_group(), mesh.group("shard"));
    EXPECT_EQ(model.replicate_group(), nullptr);
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(kLr));
    Net b;
    load_values(*b, init);
    ddp::DistributedDataParallel<Net> reference(b, mesh.group("shard"));
    torch::optim::Adam ref_opt(reference.parameters(), torch::optim::AdamOptions(kLr));
    for (const auto& batch : stage_batches[stage]) {
      step_both(model, opt, reference, ref_opt, batch, r, 2);
    }
    fsdp_got[rank] = full_values(model.full_parameters());
    ddp_got[rank] = values_of(*b);
  });
  for (int rank = 0; rank < world; ++rank) {
    EXPECT_LE(max_abs_diff(ddp_got[rank], fsdp_got[rank]), 1e-5) << "rank " << rank;
  }
  EXPECT_GT(max_abs_diff(fsdp_got[0], fsdp_got[2]), 1e-3) << "the stages did not train apart";
}

// HSDP 2x2 at world 4: shard groups {0, 1} and {2, 3}, replicate groups {0, 2} and {1, 3}.
// The same parameters as tdist's DDP over the whole world after 20 Adam steps, sharded through
// FSDPOptions::shard_size and through a DeviceMesh; only rank 0 starts with the values, so the
// others get them through both groups' broadcasts.
TEST(FSDPParity, HybridShardingMatchesTdistDDPAtWorld4) {
  const int world = 4;
  const int steps = 20;
  torch::manual_seed(13);
  Net init_net;
  auto init = values_of(*init_net);
  auto batches = make_batches(steps, 4 * world, 17);
  for (bool via_mesh : {false, true}) {
    std::vector<std::vector<torch::Tensor>> fsdp_got(world), ddp_got(world), shards(world);
    spawn(world, [&](int rank, std::shared_ptr<Store> store) {
      auto pg = make_group(store, rank, world);
      Net a;
      if (rank == 0) load_values(*a, init);
      std::unique_ptr<comm::DeviceMesh> mesh;
      fsdp::FSDPOptions opts;
      if (via_mesh) {
        mesh = std::make_unique<comm::DeviceMesh>(
            pg, std::vector<comm::DeviceMesh::Dim>{{"replicate", 2}, {"shard", 2}});
      } else {
        opts.shard_size = 2;
      }
      auto model = via_mesh ? fsdp::fully_shard(a, units_of(a), *mesh)
                            : fsdp::fully_shard(a, units_of(a), pg, opts);
      ASSERT_EQ(model.process_group()->size(), 2);
      ASSERT_NE(model.replicate_group(), nullptr);
      EXPECT_EQ(model.replicate_group()->size(), 2);
      EXPECT_EQ(model.process_group()->rank(), rank % 2);
      EXPECT_EQ(model.replicate_group()->rank(), rank / 2);
      auto& st = model.state();
      for (size_t g = 0; g < st.num_groups(); ++g) {  // sharded in 2, not in 4
        EXPECT_EQ(st.group(g).sharded_param().numel() * 2, st.group(g).padded_numel());
      }
      torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(kLr));
      Net b;
      load_values(*b, init);
      ddp::DistributedDataParallel<Net> reference(b, pg);
      torch::optim::Adam ref_opt(reference.parameters(), torch::optim::AdamOptions(kLr));
      for (const auto& batch : batches) {
        step_both(model, opt, reference, ref_opt, batch, rank, world);
      }
      const size_t groups = st.num_groups();
      EXPECT_EQ(model.counters().reduce_scatters, groups * steps);
      EXPECT_EQ(model.counters().replica_allreduces, groups * steps);
      for (const auto& p : model.parameters()) shards[rank].push_back(p.detach().clone());
      fsdp_got[rank] = full_values(model.full_parameters());
      ddp_got[rank] = values_of(*b);
    });
    EXPECT_GT(max_abs_diff(init, ddp_got[0]), 1e-3);
    for (int r = 0; r < world; ++r) {
      EXPECT_LE(max_abs_diff(ddp_got[r], fsdp_got[r]), 1e-5)
          << "rank " << r << " mesh " << via_mesh;
    }
    for (int r = 0; r < 2; ++r) {  // replicas hold the same shards, bit for bit
      ASSERT_EQ(shards[r].size(), shards[r + 2].size());
      for (size_t i = 0; i < shards[r].size(); ++i) {
        EXPECT_TRUE(torch::equal(shards[r][i], shards[r + 2][i]))
            << "ranks " << r << ", " << r + 2 << " group " << i;
      }
    }
  }
}

}  // namespace
}  // namespace tdist::test
