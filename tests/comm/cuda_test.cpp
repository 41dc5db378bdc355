// CUDA tensors through tdist::comm (issue 12): the ring backend staging them through host memory
// (Note [Staging device tensors]), the NCCL backend built on PyTorch's ProcessGroupNCCL (Note
// [NCCL works]) and the per-device dispatch (Note [Device dispatch]). The C10dStore and backend
// string tests run everywhere; the others need a GPU and skip, saying so, where none is visible.

#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <atomic>
#include <numeric>
#include <string>
#include <tuple>

#include "tdist/comm/ring/staging.h"
#include "tdist/comm/nccl/c10d_store.h"
#include "tdist/comm/nccl/nccl_process_group.h"
#include "tdist/core/tcp_store.h"
#include "tests/comm/comm_test_util.h"
#include "tests/comm/every_op.h"
#include "tests/harness/expect.h"

namespace tdist::comm {
namespace {

using tdist::test::contains;
using tdist::test::spawn;
using test::test_options;

#define SKIP_WITHOUT_GPUS(n)                                                                 \
  if (!torch::cuda::is_available() || torch::cuda::device_count() < (n))                     \
  GTEST_SKIP() << "needs " << (n) << " visible GPU(s); " << int(torch::cuda::device_count()) \
               << " visible"

// ProcessGroupNCCL exchanges its NCCL ids through this adapter: every c10d call against a real
// TCPStore server, including the timeouts.
TEST(C10dStore, ServesC10dCallsOverATcpStore) {
  TCPStoreOptions server;
  server.is_server = true;
  auto host = std::make_shared<TCPStore>(server);
  TCPStoreOptions client;
  client.port = host->port();
  auto store = c10::make_intrusive<nccl::C10dStore>(std::make_shared<TCPStore>(client),
                                                    std::chrono::milliseconds(300));
  store->set("a", std::vector<uint8_t>{1, 2, 3});
  EXPECT_EQ(store->get("a"), (std::vector<uint8_t>{1, 2, 3}));
  EXPECT_EQ(host->get("a"), (Bytes{1, 2, 3}));  // the same key, unprefixed
  EXPECT_EQ(store->add("n", 5), 5);
  EXPECT_EQ(store->add("n", -2), 3);
  EXPECT_EQ(store->compareSet("c", {}, {7}), (std::vector<uint8_t>{7}));
  EXPECT_EQ(store->compareSet("c", {8}, {9}), (std::vector<uint8_t>{7}));
  EXPECT_EQ(store->compareSet("c", {7}, {9}), (std::vector<uint8_t>{9}));
  EXPECT_TRUE(store->check({"a", "n"}));
  EXPECT_FALSE(store->check({"a", "missing"}));
  EXPECT_EQ(store->getNumKeys(), host->num_keys());
  EXPECT_TRUE(store->deleteKey("a"));
  EXPECT_FALSE(store->deleteKey("a"));
  // get of a missing key and wait time out after the store's timeout (or the one given).
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(store->get("missing"), TimeoutError);
  EXPECT_THROW(store->wait({"missing"}), TimeoutError);
  EXPECT_THROW(store->wait({"missing"}, std::chrono::milliseconds(100)), TimeoutError);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  store->setTimeout(std::chrono::milliseconds(5000));
  auto copy = store->clone();
  EXPECT_EQ(copy->getTimeout(), std::chrono::milliseconds(5000));
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    host->set("late", "x");
  });
  EXPECT_EQ(copy->get("late"), (std::vector<uint8_t>{'x'}));  // blocks until it is set
  late.join();
}

TEST(DeviceDispatch, BackendStrings) {
  auto store = std::make_shared<HashStore>();
  ProcessGroup::Options o;
  EXPECT_EQ(o.backend, "auto");
  EXPECT_EQ(create_process_group(store, 0, 1, o)->backend_name(),
            torch::cuda::is_available() ? "cpu:ring,cuda:nccl" : "ring");
  {
    tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_CUDA_BACKEND", "ring"}});
    EXPECT_EQ(create_process_group(store, 0, 1, o)->backend_name(), "ring");
  }
  {
    tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_CUDA_BACKEND", "gloo"}});
    EXPECT_THROW(create_process_group(store, 0, 1, o), InvalidArgument);
  }
  o.backend = "cpu:ring,cuda:ring";  // CUDA tensors staged through the ring
  EXPECT_EQ(create_process_group(store, 0, 1, o)->backend_name(), "ring");
  o.backend = "cuda:ring";
  EXPECT_THROW(create_process_group(store, 0, 1, o), InvalidArgument);  // no CPU backend
  o.backend = "cpu:ring,cuda:gloo";
  EXPECT_THROW(create_process_group(store, 0, 1, o), InvalidArgument);
  o.backend = "cpu:ring,cuda:nccl";
  if (torch::cuda::is_available()) {
    auto pg = create_process_group(store, 0, 1, o);
    EXPECT_EQ(pg->backend_name(), "cpu:ring,cuda:nccl");
    auto x = torch::ones({4});
    pg->allreduce(x)->wait();  // CPU tensors still go through the ring
    EXPECT_TRUE(torch::equal(x, torch::ones({4})));
    EXPECT_THROW(pg->allgather({torch::ones({4})}, torch::ones({4}, torch::kCUDA)),
                 InvalidArgument);  // mixes devices
  } else {
    // Without a GPU ProcessGroupNCCL refuses to start: the error says which backend and why.
    try {
      create_process_group(store, 0, 1, o);
      ADD_FAILURE() << "cuda:nccl started without a GPU";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(contains(e.what(), "nccl backend")) << e.what();
    }
  }
}

// The ring named: "auto" sends CUDA tensors to NCCL where a GPU is visible, and NCCL refuses two
// ranks on one GPU.
ProcessGroup::Options ring_options() {
  auto o = test_options();
  o.backend = "ring";
  return o;
}

// With overlapped staging (the default pieces), without it (TDIST_STAGING_PIECE_BYTES=0: the
// large tensors copied in and out whole), and with windows of 3 MiB (Note [Windows]: the 6 MiB
// allreduce_coalesced runs two, the second copied in from a side stream, the 4 MiB broadcast and
// reduce two, and the allgathers, reduce-scatters, gathers, scatters and alltoalls of 4 MiB blocks
// three or more), and with every allreduce by recursive doubling in those windows.
TEST(RingOnCuda, EveryOpWithRanksSharingOneGpu) {
  SKIP_WITHOUT_GPUS(1);
  for (auto [piece, window, algo] :
       {std::tuple<const char*, const char*, const char*>{"1048576", "67108864", "auto"},
        {"0", "67108864", "auto"},
        {"1048576", "3145728", "auto"},
        {"1048576", "3145728", "recursive_doubling"}}) {
    tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_STAGING_PIECE_BYTES", piece},
                                                   {"TDIST_WINDOW_BYTES", window},
                                                   {"TDIST_ALLREDUCE_ALGO", algo}});
    for (int n : {2, 4}) {
      SCOPED_TRACE(
          str("TDIST_STAGING_PIECE_BYTES=", piece, ", window ", window, ", ", algo, ", world ", n));
      const size_t before = detail::staged_buffers_for_tests();
      spawn(n, [&](int rank, std::shared_ptr<Store> store) {
        c10::DeviceGuard on(c10::Device(c10::kCUDA, 0));
        test::check_every_op(create_process_group(store, rank, n, ring_options()),
                             c10::Device(c10::kCUDA, 0));
      });
      const size_t staged = detail::staged_buffers_for_tests() - before;
      if (std::string(piece) == "0") {
        EXPECT_EQ(staged, 0u);
      } else {
        EXPECT_GT(staged, 0u);
      }
    }
  }
}

// A CPU tensor on one rank meets a CUDA tensor on the other (the fingerprint is dtype and shape).
TEST(RingOnCuda, ACpuRankAndACudaRankReduceTogether) {
  SKIP_WITHOUT_GPUS(1);
  spawn(2, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 2, ring_options());
    for (int64_t len : {int64_t(100), int64_t(3) << 20}) {  // the second one staged in pieces
      auto x = torch::full({len}, rank + 1.0);
      if (rank == 1) x = x.to(torch::kCUDA);
      pg->allreduce(x)->wait();
      EXPECT_TRUE(torch::equal(x.cpu(), torch::full({len}, 3.0))) << len;
    }
  });
}

// Windowed collectives (Note [Windows]) keep the caller's stream order: their inputs are filled,
// and their outputs overwritten with -1, on a stream of the caller's own behind slow kernels, and
// nothing waits for that before the call. The copies in must read the filled values (also the
// windows copied in later from a side stream), and no copy out may land before the -1s.
TEST(RingOnCuda, WindowedCollectivesKeepTheCallersStreamOrder) {
  SKIP_WITHOUT_GPUS(1);
  tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_WINDOW_BYTES", "4194304"}});
  spawn(2, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 2, ring_options());
    const c10::Device dev(c10::kCUDA, 0);
    c10::impl::VirtualGuardImpl impl(dev.type());
    c10::StreamGuard on(impl.getStreamFromGlobalPool(dev));
    auto slow = [] {
      auto m = torch::rand({2048, 2048}, torch::kCUDA);
      for (int i = 0; i < 8; ++i) m = torch::mm(m, m).div_(2048);
    };
    const int64_t len = int64_t(7) << 20;  // 28 MiB: 7 windows of the allreduce
    const auto sum = torch::full({len}, 3.0);
    auto x = torch::zeros({len}, torch::kCUDA);
    slow();
    x.fill_(rank + 1.0);
    pg->allreduce(x)->wait();
    EXPECT_TRUE(torch::equal(x.cpu(), sum)) << "allreduce";
    auto in = torch::zeros({len}, torch::kCUDA), gathered = torch::zeros({2 * len}, torch::kCUDA);
    slow();
    in.fill_(rank + 1.0);
    gathered.fill_(-1.0);
    pg->allgather_into_tensor(gathered, in)->wait();
    EXPECT_TRUE(torch::equal(gathered.cpu(),
                             torch::cat({torch::full({len}, 1.0), torch::full({len}, 2.0)})))
        << "allgather_into_tensor";
    auto rs_in = torch::zeros({2 * len}, torch::kCUDA), rs_out = torch::zeros({len}, torch::kCUDA);
    slow();
    rs_in.fill_(rank + 1.0);
    rs_out.fill_(-1.0);
    pg->reduce_scatter_tensor(rs_out, rs_in)->wait();
    EXPECT_TRUE(torch::equal(rs_out.cpu(), sum)) << "reduce_scatter_tensor";
    auto b = torch::zeros({len}, torch::kCUDA);
    slow();
    b.fill_(rank == 0 ? 5.0 : -1.0);
    pg->broadcast(b)->wait();
    EXPECT_TRUE(torch::equal(b.cpu(), torch::full({len}, 5.0))) << "broadcast";
    auto red = torch::zeros({len}, torch::kCUDA);
    slow();
    red.fill_(rank + 1.0);
    ReduceOptions ro;
    ro.root = 1;
    pg->reduce(red, ro)->wait();
    EXPECT_TRUE(torch::equal(red.cpu(), rank == 1 ? sum : torch::full({len}, 1.0))) << "reduce";
  });
}

// A staged allreduce whose peer never calls fails within the timeout (a timeout, or the lost
// connection once the peer's group is gone), and leaves the tensor usable.
TEST(RingOnCuda, AStagedAllreduceWhosePeerNeverCallsFails) {
  SKIP_WITHOUT_GPUS(1);
  spawn(2, [&](int rank, std::shared_ptr<Store> store) {
    auto o = ring_options();
    o.timeout = Millis(500);
    auto pg = create_process_group(store, rank, 2, o);
    if (rank == 1) return;
    auto big = torch::ones({int64_t(3) << 20}, torch::kCUDA);
    EXPECT_THROW(pg->allreduce(big)->wait(), tdist::Error);
    EXPECT_EQ(big.sum().item<double>(), double(3 << 20));  // copies done, memory intact
  });
}

// Options::device_id: checked before any backend starts, and by the NCCL backend against the
// visible GPUs (here, without a GPU, every id is refused with the count it saw).
TEST(DeviceDispatch, ABadDeviceIdIsRefusedSayingWhy) {
  auto store = std::make_shared<HashStore>();
  ProcessGroup::Options o;
  o.device_id = -1;
  try {
    create_process_group(store, 0, 1, o);
    ADD_FAILURE() << "device_id -1 was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(contains(e.what(), "device_id must be >= 0, got -1")) << e.what();
  }
  o.backend = "cpu:ring,cuda:nccl";
  o.device_id = static_cast<int>(torch::cuda::device_count());  // one past the last GPU
  try {
    create_process_group(store, 0, 1, o);
    ADD_FAILURE() << "device_id " << *o.device_id << " was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(contains(e.what(), "is not a visible GPU")) << e.what();
  }
  o.backend = "ring";  // the ring does not use the device
  EXPECT_EQ(create_process_group(store, 0, 1, o)->backend_name(), "ring");
}

// Note [Split communicators]: with a device_id the subgroup's communicator is split from the
// parent's (the parent counts the split), and collectives on it give the right results; without
// one the subgroup bootstraps its own and nothing is split.
TEST(NcclBackend, NewGroupSplitsTheBoundParentsCommunicator) {
  SKIP_WITHOUT_GPUS(1);
  const int n = std::min<int>(2, static_cast<int>(torch::cuda::device_count()));
  spawn(n, [&](int rank, std::shared_ptr<Store> store) {
    c10::DeviceGuard on(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(rank)));
    const auto dev = torch::Device(torch::kCUDA, rank);
    auto o = test_options();
    o.device_id = rank;
    std::vector<int> everyone(n);
    std::iota(everyone.begin(), everyone.end(), 0);
    nccl::NcclProcessGroup bound(store, "bound", rank, n, o);
    auto all = bound.new_group(everyone, o);
    ASSERT_NE(all, nullptr);
    auto x = torch::full({1024}, rank + 1.0, dev);
    all->allreduce(x)->synchronize();
    EXPECT_TRUE(torch::equal(x.cpu(), torch::full({1024}, n * (n + 1) / 2.0)));
    EXPECT_EQ(bound.comm_split_count(), 1u);
    // Only the last rank: the others take part in the split with no colour and get no group.
    auto last = bound.new_group({n - 1}, o);
    EXPECT_EQ(last == nullptr, rank != n - 1);
    if (last) {
      auto y = torch::full({16}, 5.0, dev);
      last->allreduce(y)->synchronize();
      EXPECT_TRUE(torch::equal(y.cpu(), torch::full({16}, 5.0)));
    }
    // No device_id: the subgroup makes its own communicator at its first operation.
    auto lazy_opts = test_options();
    nccl::NcclProcessGroup lazy(store, "lazy", rank, n, lazy_opts);
    auto sub = lazy.new_group(everyone, lazy_opts);
    auto z = torch::ones({8}, dev);
    sub->allreduce(z)->synchronize();
    EXPECT_TRUE(torch::equal(z.cpu(), torch::full({8}, static_cast<float>(n))));
    EXPECT_EQ(lazy.comm_split_count(), 0u);
  });
}

// NCCL through the dispatch: one rank per GPU (NCCL refuses two ranks on one GPU).
TEST(NcclBackend, EveryOpAgainstTheRingOnOneRankPerGpu) {
  SKIP_WITHOUT_GPUS(1);
  const int n = std::min<int>(2, static_cast<int>(torch::cuda::device_count()));
  spawn(n, [&](int rank, std::shared_ptr<Store> store) {
    c10::DeviceGuard on(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(rank)));
    auto o = test_options();
    o.backend = "cpu:ring,cuda:nccl";
    auto pg = create_process_group(store, rank, n, o);
    ASSERT_EQ(pg->backend_name(), "cpu:ring,cuda:nccl");
    auto x = (torch::arange(1 << 20, torch::kFloat) + rank).to(torch::Device(torch::kCUDA, rank));
    auto w = pg->allreduce(x);
    w->wait();  // the current stream waits: the kernel below reads the result without a host sync
    auto doubled = x * 2;
    at::Tensor expect = torch::zeros({1 << 20});
    for (int k = 0; k < n; ++k) expect += torch::arange(1 << 20, torch::kFloat) + k;
    EXPECT_TRUE(torch::equal(doubled.cpu(), expect * 2));
    w->synchronize();
    EXPECT_TRUE(w->future()->completed());
    auto g = torch::empty({n, 8}, x.options());
    pg->allgather_into_tensor(g, torch::full({8}, rank + 1.0, x.options()))->wait();
    for (int k = 0; k < n; ++k) EXPECT_TRUE(torch::equal(g[k].cpu(), torch::full({8}, k + 1.0)));
    auto b = torch::full({16}, rank + 1.0, x.options());
    pg->broadcast(b)->wait();
    EXPECT_TRUE(torch::equal(b.cpu(), torch::ones({16})));
    auto rs = torch::empty({4}, x.options());
    pg->reduce_scatter_tensor(rs, torch::ones({4 * n}, x.options()))->wait();
    EXPECT_TRUE(torch::equal(rs.cpu(), torch::full({4}, static_cast<float>(n))));
    pg->barrier()->wait();
    std::atomic<bool> ran{false};
    pg->allreduce(x)
        ->future()
        ->then([&](Future& f) {
          ran = true;
          return f.value();
        })
        ->wait();
    EXPECT_TRUE(ran.load());
  });
}

}  // namespace
}  // namespace tdist::comm
