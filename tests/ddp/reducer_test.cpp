// Reducer behaviour: bucket assignment, overlap (by order), rebuild, and its errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>

#include "tdist/core/error.h"
#include "tdist/ddp/bucket.h"
#include "tdist/ddp/model_sync.h"
#include "tdist/ddp/reducer.h"
#include "tests/ddp/ddp_test_util.h"

namespace tdist::test {
namespace {

using ddp::DDPOptions;
using ddp::DistributedDataParallel;

std::vector<size_t> reversed(size_t n) {
  std::vector<size_t> o(n);
  for (size_t i = 0; i < n; ++i) o[i] = n - 1 - i;
  return o;
}

TEST(DDPBuckets, ReverseOrderWithFirstBucketCap) {
  // 4 float params of 100, 200, 300, 400 elements (400 B .. 1600 B).
  std::vector<at::Tensor> p;
  for (int n : {100, 200, 300, 400}) p.push_back(at::zeros({n}));
  // First cap 1000 B, then 1500 B: [3](1600) | [2,1](1200+800) | [0]
  auto b = ddp::assign_buckets(p, reversed(4), 1000, 1500);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0], (std::vector<size_t>{3}));
  EXPECT_EQ(b[1], (std::vector<size_t>{2, 1}));
  EXPECT_EQ(b[2], (std::vector<size_t>{0}));
  // One huge cap: one bucket in the given order.
  auto one = ddp::assign_buckets(p, reversed(4), 1 << 30, 1 << 30);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0], reversed(4));
}

TEST(DDPBuckets, DtypesNeverShareABucket) {
  std::vector<at::Tensor> p{at::zeros({10}), at::zeros({10}, at::kDouble), at::zeros({10}),
                            at::zeros({10}, at::kDouble)};
  auto b = ddp::assign_buckets(p, reversed(4), 1 << 20, 1 << 20);
  ASSERT_EQ(b.size(), 2u);
  // Ordered by their first parameter in the order: 3 (double) first.
  EXPECT_EQ(b[0], (std::vector<size_t>{3, 1}));
  EXPECT_EQ(b[1], (std::vector<size_t>{2, 0}));
}

TEST(DDPBuckets, BadOrderIsRejected) {
  std::vector<at::Tensor> p{at::zeros({1}), at::zeros({1})};
  EXPECT_THROW(ddp::assign_buckets(p, {0, 0}, 10, 10), InvalidArgument);
  EXPECT_THROW(ddp::assign_buckets(p, {0}, 10, 10), InvalidArgument);
  EXPECT_THROW(ddp::assign_buckets(p, {0, 2}, 10, 10), InvalidArgument);
}

// The first bucket's allreduce is issued before the gradient of the first layer's weight (the
// last gradient backward produces) exists: communication overlaps backward.
TEST(DDPReducer, FirstBucketLaunchesBeforeLastGradientIsReady) {
  torch::set_num_threads(1);
  const int world = 2;
  std::mutex mu;
  std::vector<std::vector<std::string>> events(world);
  std::vector<std::thread> threads;
  std::exception_ptr error;
  // Record every issued operation per rank (from the first forward on).
  std::atomic<bool> recording{false};
  auto record = [&](int rank, const std::string& what) {
    if (!recording) return;
    std::lock_guard<std::mutex> lock(mu);
    events[rank].push_back(what);
  };
  auto w = std::make_shared<FakeWorld>(world);
  w->set_on_issue([&](int rank, const std::string& op, uint64_t) { record(rank, op); });
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto pg = std::make_shared<FakeProcessGroup>(w, r);
        MLP net;
        DDPOptions opts;
        opts.bucket_cap_mb = 1e-6;  // one bucket per parameter
        DistributedDataParallel<MLP> model(net, pg, opts);
        // Fires when fc1.weight's gradient is computed, before it is accumulated.
        net->fc1->weight.register_hook([&, r](torch::Tensor g) {
          record(r, "fc1.weight grad");
          return g;
        });
        auto x = torch::randn({4, 6});
        recording = true;
        torch::mse_loss(model(x), torch::zeros({4, 3})).backward();
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
  for (int r = 0; r < world; ++r) {
    const auto& ev = events[r];
    auto grad = std::find(ev.begin(), ev.end(), "fc1.weight grad");
    ASSERT_NE(grad, ev.end()) << "rank " << r;
    auto first_allreduce = std::find(ev.begin(), ev.end(), "allreduce");
    ASSERT_NE(first_allreduce, ev.end()) << "rank " << r;
    EXPECT_LT(first_allreduce - ev.begin(), grad - ev.begin())
        << "rank " << r << ": the first bucket's allreduce was not issued before the last gradient";
    // 6 parameters, 6 buckets: 6 allreduces, 5 of them before fc1.weight's gradient.
    EXPECT_EQ(std::count(ev.begin(), ev.end(), "allreduce"), 6);
    EXPECT_EQ(std::count(ev.begin(), grad, "allreduce"), 5);
  }
}

// Registered in an order opposite to use: the initial buckets (reverse registration order) are
// wrong; after the first iteration they follow the order gradients became ready.
struct ShuffledImpl : torch::nn::Module {
  ShuffledImpl()
      : last(register_module("last", torch::nn::Linear(8, 3))),
        first(register_module("first", torch::nn::Linear(6, 8))) {}
  torch::Tensor forward(const torch::Tensor& x) { return last(torch::relu(first(x))); }
  torch::nn::Linear last, first;
};
TORCH_MODULE(Shuffled);

TEST(DDPReducer, BucketsRebuiltInReadyOrderOnce) {
  torch::set_num_threads(1);
  std::vector<std::vector<std::vector<size_t>>> before(2), after(2);
  run_ranks(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> pg) {
    Shuffled net;
    DDPOptions opts;
    opts.bucket_cap_mb = 1e-6;
    DistributedDataParallel<Shuffled> model(net, pg, opts);
    before[rank] = model.reducer().bucket_indices();
    for (int it = 0; it < 3; ++it) {
      torch::mse_loss(model(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
      if (it == 0) {
        EXPECT_FALSE(model.reducer().buckets_rebuilt());
      }
    }
    EXPECT_TRUE(model.reducer().buckets_rebuilt());
    after[rank] = model.reducer().bucket_indices();
  });
  // Parameters: 0 last.weight, 1 last.bias, 2 first.weight, 3 first.bias.
  // Before: reverse registration order puts first.* first.
  EXPECT_EQ(before[0].front(), (std::vector<size_t>{3}));
  // After: last.* (whose gradients come first) lead; first.weight comes last.
  EXPECT_TRUE(after[0].front() == std::vector<size_t>{1} ||
              after[0].front() == std::vector<size_t>{0});
  EXPECT_EQ(after[0].back(), (std::vector<size_t>{2}));
  EXPECT_EQ(after[0], after[1]);
}

TEST(DDPReducer, UnusedParameterWithoutFindUnusedNamesIt) {
  torch::set_num_threads(1);
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> pg) {
    BranchNet net;
    DistributedDataParallel<BranchNet> model(net, pg);
    auto x = torch::randn({4, 6});
    try {
      torch::mse_loss(model(x), torch::zeros({4, 3})).backward();
    } catch (const std::exception& e) {
      messages[rank] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(messages[r].find("unused.weight"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("unused.bias"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("find_unused_parameters"), std::string::npos) << messages[r];
    EXPECT_EQ(messages[r].find("fc1.weight"), std::string::npos) << messages[r];
  }
}

TEST(DDPReducer, ForwardAgainBeforeBackwardFails) {
  torch::set_num_threads(1);
  run_ranks(2, [&](int, std::shared_ptr<comm::ProcessGroup> pg) {
    BranchNet net;
    DDPOptions opts;
    opts.find_unused_parameters = true;
    DistributedDataParallel<BranchNet> model(net, pg, opts);
    auto x = torch::randn({4, 6});
    auto out = model(x);
    // The marking began (`unused` was marked ready after forward), the backward never came.
    try {
      model(x);
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("prior iteration"), std::string::npos) << e.what();
    }
    // After the error the model works again.
    torch::mse_loss(model(x), torch::zeros({4, 3})).backward();
    EXPECT_TRUE(net->fc1->weight.grad().defined());
  });
}

TEST(DDPReducer, NoGradForwardDoesNotSync) {
  torch::set_num_threads(1);
  run_ranks(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> pg) {
    MLP net;
    DistributedDataParallel<MLP> model(net, pg);
    if (rank == 0) {
      // Only rank 0 evaluates: no collective may be issued, or rank 1 would be out of step.
      torch::NoGradGuard g;
      model(torch::randn({2, 6}));
    }
    torch::mse_loss(model(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
  });
}

TEST(DDPReducer, MismatchedModelsNameParameterAndRanks) {
  torch::set_num_threads(1);
  std::vector<std::string> messages(3);
  run_ranks(3, [&](int rank, std::shared_ptr<comm::ProcessGroup> pg) {
    MLP net(6, rank == 2 ? 9 : 8, 3);
    try {
      DistributedDataParallel<MLP> model(net, pg);
    } catch (const InvalidArgument& e) {
      messages[rank] = e.what();
    }
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(messages[r].find("fc1.weight"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("[8, 6] on rank 0"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("[9, 6] on rank(s) 2"), std::string::npos) << messages[r];
  }
}

// The model check allgathers each rank's signature length before the signatures: a length far
// beyond the shortest (here a forged 1 TiB) is a different model on every rank, not an allocation.
TEST(DDPReducer, ForgedSignatureLengthIsRefusedBeforeAllocating) {
  torch::set_num_threads(1);
  std::string message;
  run_ranks(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> pg) {
    if (rank == 1) {
      // A peer that announces an enormous signature and then sends nothing.
      std::vector<at::Tensor> lens = {at::empty({1}, at::kLong), at::empty({1}, at::kLong)};
      comm::AllgatherOptions opts;
      opts.timeout = std::chrono::seconds(20);
      pg->allgather(lens, at::full({1}, int64_t(1) << 40, at::kLong), opts)->wait();
      return;
    }
    std::vector<ddp::TensorSignature> mine = {
        ddp::signature_of("parameter", "w", torch::zeros({3, 2}))};
    try {
      ddp::verify_same_across_ranks(*pg, mine, std::chrono::seconds(20));
    } catch (const InvalidArgument& e) {
      message = e.what();
    }
  });
  EXPECT_NE(message.find("the model differs across ranks"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 1's model signature is 1099511627776 bytes"), std::string::npos)
      << message;
}

TEST(DDPReducer, MissingParameterNamed) {
  torch::set_num_threads(1);
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> pg) {
    auto seq = torch::nn::Sequential(torch::nn::Linear(4, 4));
    if (rank == 1) seq->push_back(torch::nn::Linear(4, 2));
    try {
      DistributedDataParallel<torch::nn::Sequential> model(seq, pg);
    } catch (const InvalidArgument& e) {
      messages[rank] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(messages[r].find("parameter 1.weight"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("missing on rank 0"), std::string::npos) << messages[r];
  }
}

TEST(DDPReducer, ConstructionBroadcastsRankZerosState) {
  torch::set_num_threads(1);
  std::vector<std::vector<torch::Tensor>> states(3);
  run_ranks(3, [&](int rank, std::shared_ptr<comm::ProcessGroup> pg) {
    BNNet net;
    {
      torch::NoGradGuard g;
      net->bn->running_mean.fill_(rank);
    }
    DistributedDataParallel<BNNet> model(net, pg);
    states[rank] = state_of(*net);
  });
  EXPECT_EQ(max_abs_diff(states[0], states[1]), 0.0);
  EXPECT_EQ(max_abs_diff(states[0], states[2]), 0.0);
}

TEST(DDPReducer, FailedHookFailsBackwardNamingTheBucket) {
  torch::set_num_threads(1);
  run_ranks(2, [&](int, std::shared_ptr<comm::ProcessGroup> pg) {
    MLP net;
    DistributedDataParallel<MLP> model(net, pg);
    model.register_comm_hook([](ddp::GradBucket&) {
      return comm::Future::failed(std::make_exception_ptr(NetworkError("peer 1 hung up")));
    });
    try {
      torch::mse_loss(model(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
      ADD_FAILURE() << "expected an error";
    } catch (const std::exception& e) {
      std::string m = e.what();
      EXPECT_NE(m.find("bucket 0"), std::string::npos) << m;
      EXPECT_NE(m.find("peer 1 hung up"), std::string::npos) << m;
    }
  });
}

TEST(DDPReducer, HookThatNeverCompletesTimesOut) {
  torch::set_num_threads(1);
  run_ranks(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> pg) {
    MLP net;
    DDPOptions opts;
    opts.timeout = std::chrono::milliseconds(200);
    DistributedDataParallel<MLP> model(net, pg, opts);
    auto never = std::make_shared<comm::Future>();
    model.register_comm_hook([never](ddp::GradBucket&) { return never; });
    try {
      torch::mse_loss(model(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
      ADD_FAILURE() << "expected a timeout";
    } catch (const std::exception& e) {
      std::string m = e.what();
      EXPECT_NE(m.find("rank " + std::to_string(rank)), std::string::npos) << m;
      EXPECT_NE(m.find("waited 200 ms"), std::string::npos) << m;
    }
  });
}

// A peer that stops taking part (here: a thread that leaves before backward) makes the others'
// backward fail within the group's timeout instead of hanging.
TEST(DDPReducer, PeerGoneDuringBackwardIsAnErrorNotAHang) {
  torch::set_num_threads(1);
  comm::ProcessGroup::Options popts;
  popts.timeout = std::chrono::milliseconds(300);
  std::string message;
  run_ranks(
      2,
      [&](int rank, std::shared_ptr<comm::ProcessGroup> pg) {
        MLP net;
        DDPOptions opts;
        opts.timeout = std::chrono::seconds(10);  // the group's 300 ms fires first
        DistributedDataParallel<MLP> model(net, pg, opts);
        if (rank == 1) return;  // gone
        try {
          torch::mse_loss(model(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
          ADD_FAILURE() << "expected an error";
        } catch (const std::exception& e) {
          message = e.what();
        }
      },
      popts);
  EXPECT_NE(message.find("bucket 0"), std::string::npos) << message;
  EXPECT_NE(message.find("rank(s) 1"), std::string::npos) << message;
}

TEST(DDPReducer, BadOptionsRejected) {
  auto pg = make_fake_groups(1)[0];
  MLP net;
  DDPOptions opts;
  opts.bucket_cap_mb = 0;
  EXPECT_THROW(DistributedDataParallel<MLP>(net, pg, opts), InvalidArgument);
  EXPECT_THROW(DistributedDataParallel<MLP>(net, nullptr), InvalidArgument);
}

TEST(DDPReducer, FindUnusedNeedsVisibleOutputs) {
  struct OpaqueImpl : torch::nn::Module {
    OpaqueImpl() : fc(register_module("fc", torch::nn::Linear(2, 2))) {}
    struct Out {
      torch::Tensor t;
    };
    Out forward(const torch::Tensor& x) { return {fc(x)}; }
    torch::nn::Linear fc;
  };
  auto pg = make_fake_groups(1)[0];
  auto net = std::make_shared<OpaqueImpl>();
  DDPOptions opts;
  opts.find_unused_parameters = true;
  {
    DistributedDataParallel<std::shared_ptr<OpaqueImpl>> model(net, pg, opts);
    EXPECT_THROW(model(torch::randn({1, 2})), Error);
  }
  // Without find_unused_parameters any result type works.
  DistributedDataParallel<std::shared_ptr<OpaqueImpl>> plain(net, pg);
  plain(torch::randn({1, 2})).t.sum().backward();
  EXPECT_TRUE(net->fc->weight.grad().defined());
}

}  // namespace
}  // namespace tdist::test
