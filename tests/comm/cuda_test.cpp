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

#include "tdist/comm/detail/staging.h"
#include "tdist/comm/nccl/c10d_store.h"
#include "tdist/comm/nccl/nccl_process_group.h"
#include "tdist/core/tcp_store.h"
#include "tests/comm/comm_test_util.h"
#include "tests/harness/expect.h"

namespace tdist::comm {
namespace {

using tdist::test::contains;
using tdist::test::spawn;
using test::test_options;

#define SKIP_WITHOUT_GPUS(n)                                                             \
  if (!torch::cuda::is_available() || torch::cuda::device_count() < (n))                 \
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

// Every operation of the ring backend on CUDA tensors, several ranks sharing GPU 0, against the
// same operation on CPU tensors.
void check_ops_on_cuda(const std::shared_ptr<ProcessGroup>& pg) {
  const int r = pg->rank(), n = pg->size();
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  auto input = [&](int rank, int64_t len) { return torch::arange(len, torch::kFloat) + rank * 100; };
  // allreduce, every op on floats and ints, and a non-contiguous tensor.
  for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX, ReduceOp::MIN}) {
    auto x = input(r, 1000).to(torch::kCUDA);
    AllreduceOptions ao;
    ao.op = op;
    pg->allreduce(x, ao)->wait();
    std::vector<at::Tensor> all;
    for (int k = 0; k < n; ++k) all.push_back(input(k, 1000));
    EXPECT_TRUE(x.is_cuda());
    EXPECT_TRUE(torch::allclose(x.cpu(), test::reference(all, op))) << to_string(op);
  }
  // Large enough for overlapped staging (Note [Overlapped staging]): written by a kernel queued
  // just before the call (the copies in wait for it on the same stream).
  for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG}) {
    auto base = torch::arange(int64_t(3) << 20, torch::kFloat).remainder(1000);  // 12 MiB
    auto big = base.to(torch::kCUDA);
    big.mul_(r + 1);
    AllreduceOptions ao;
    ao.op = op;
    pg->allreduce(big, ao)->wait();
    auto want = base * (n * (n + 1) / 2);
    if (op == ReduceOp::AVG) want = want / n;
    EXPECT_TRUE(torch::allclose(big.cpu(), want)) << to_string(op);
  }
  // Large and strided: through contiguous stand-ins on the device (Note [Strided device
  // tensors]), the allreduce's written by a kernel queued just before the call; the columns
  // beside them untouched.
  {
    auto base = torch::arange(int64_t(1) << 20, torch::kFloat).remainder(1000);  // 4 MiB
    auto wide = torch::zeros({base.numel(), 2}, cuda);
    auto col = wide.select(1, 0);
    col.copy_(base.to(torch::kCUDA)).mul_(r + 1);
    pg->allreduce(col)->wait();
    const auto want = base * (n * (n + 1) / 2);
    EXPECT_TRUE(torch::equal(col.cpu(), want)) << "strided allreduce";
    std::vector<at::Tensor> strided_outs, wides;
    for (int k = 0; k < n; ++k) {
      wides.push_back(torch::zeros({base.numel(), 2}, cuda));
      strided_outs.push_back(wides.back().select(1, 1));
    }
    pg->allgather(strided_outs, col)->wait();
    for (int k = 0; k < n; ++k) {
      EXPECT_TRUE(torch::equal(strided_outs[k].cpu(), want)) << "strided allgather " << k;
      EXPECT_TRUE(torch::equal(wides[k].select(1, 0).cpu(), torch::zeros_like(base)));
    }
    EXPECT_TRUE(torch::equal(wide.select(1, 1).cpu(), torch::zeros_like(base)));
  }
  auto ints = torch::full({3, 5}, r + 1, torch::kInt).to(torch::kCUDA).t();  // non-contiguous
  pg->allreduce(ints)->wait();
  EXPECT_TRUE(torch::equal(ints.cpu(), torch::full({5, 3}, n * (n + 1) / 2, torch::kInt)));
  // broadcast
  auto b = input(r, 77).to(torch::kCUDA);
  BroadcastOptions bo;
  bo.root = n - 1;
  pg->broadcast(b, bo)->wait();
  EXPECT_TRUE(torch::equal(b.cpu(), input(n - 1, 77)));
  // allgather and allgather_into_tensor
  std::vector<at::Tensor> outs;
  for (int k = 0; k < n; ++k) outs.push_back(torch::empty({33}, cuda));
  pg->allgather(outs, input(r, 33).to(torch::kCUDA))->wait();
  auto flat = torch::empty({33 * n}, cuda);
  pg->allgather_into_tensor(flat, input(r, 33).to(torch::kCUDA))->wait();
  for (int k = 0; k < n; ++k) {
    EXPECT_TRUE(torch::equal(outs[k].cpu(), input(k, 33)));
    EXPECT_TRUE(torch::equal(flat.narrow(0, 33 * k, 33).cpu(), input(k, 33)));
  }
  // Large enough for overlapped staging: allgather into staged outputs and reduce-scatter from
  // staged inputs, the tensor and the list forms; a broadcast and a reduce.
  {
    const int64_t len = int64_t(1) << 20;  // 4 MiB per rank
    auto big = r == 0 ? input(0, len).to(torch::kCUDA) : torch::zeros({len}, cuda);
    pg->broadcast(big)->wait();
    EXPECT_TRUE(torch::equal(big.cpu(), input(0, len)));
    auto reduced = input(r, len).to(torch::kCUDA);
    ReduceOptions ro;
    ro.root = n - 1;
    pg->reduce(reduced, ro)->wait();
    at::Tensor reduced_want = torch::zeros({len});
    for (int k = 0; k < n; ++k) reduced_want += input(k, len);
    EXPECT_TRUE(torch::equal(reduced.cpu(), r == n - 1 ? reduced_want : input(r, len)));
    auto gathered = torch::empty({len * n}, cuda);
    pg->allgather_into_tensor(gathered, input(r, len).to(torch::kCUDA))->wait();
    std::vector<at::Tensor> gathered_list;
    for (int k = 0; k < n; ++k) gathered_list.push_back(torch::empty({len}, cuda));
    pg->allgather(gathered_list, input(r, len).to(torch::kCUDA))->wait();
    auto rs_in = input(r, len * n).to(torch::kCUDA);
    auto rs_out = torch::empty({len}, cuda);
    pg->reduce_scatter_tensor(rs_out, rs_in)->wait();
    auto rs_out_list = torch::empty({len}, cuda);
    pg->reduce_scatter(rs_out_list, rs_in.chunk(n))->wait();
    at::Tensor sum = torch::zeros({len * n});
    for (int k = 0; k < n; ++k) {
      EXPECT_TRUE(torch::equal(gathered.narrow(0, len * k, len).cpu(), input(k, len)));
      EXPECT_TRUE(torch::equal(gathered_list[k].cpu(), input(k, len)));
      sum += input(k, len * n);
    }
    EXPECT_TRUE(torch::equal(rs_out.cpu(), sum.narrow(0, len * r, len)));
    EXPECT_TRUE(torch::equal(rs_out_list.cpu(), sum.narrow(0, len * r, len)));
    // allreduce_coalesced: two tensors staged as one buffer
    std::vector<at::Tensor> big_parts{input(r, len).to(torch::kCUDA),
                                      input(r, len / 2 + 3).to(torch::kCUDA)};
    pg->allreduce_coalesced(big_parts)->wait();
    at::Tensor p0 = torch::zeros({len}), p1 = torch::zeros({len / 2 + 3});
    for (int k = 0; k < n; ++k) {
      p0 += input(k, len);
      p1 += input(k, len / 2 + 3);
    }
    EXPECT_TRUE(torch::equal(big_parts[0].cpu(), p0));
    EXPECT_TRUE(torch::equal(big_parts[1].cpu(), p1));
    // gather to and scatter from the last rank, and an alltoall of 4 MiB blocks
    std::vector<at::Tensor> g_big, s_big;
    if (r == n - 1) {
      for (int k = 0; k < n; ++k) {
        g_big.push_back(torch::empty({len}, cuda));
        s_big.push_back(input(k + n, len).to(torch::kCUDA));
      }
    }
    GatherOptions go;
    go.root = n - 1;
    pg->gather(g_big, input(r, len).to(torch::kCUDA), go)->wait();
    for (int k = 0; k < static_cast<int>(g_big.size()); ++k) {
      EXPECT_TRUE(torch::equal(g_big[k].cpu(), input(k, len))) << "gather, block " << k;
    }
    ScatterOptions so;
    so.root = n - 1;
    auto scattered = torch::empty({len}, cuda);
    pg->scatter(scattered, s_big, so)->wait();
    EXPECT_TRUE(torch::equal(scattered.cpu(), input(r + n, len))) << "scatter";
    auto a_big = torch::empty({len * n}, cuda);
    pg->alltoall_base(a_big, input(r, len * n).to(torch::kCUDA), {}, {})->wait();
    for (int k = 0; k < n; ++k) {
      EXPECT_TRUE(torch::equal(a_big.narrow(0, len * k, len).cpu(),
                               input(k, len * n).narrow(0, len * r, len)))
          << "alltoall_base, block " << k;
    }
  }
  // reduce_scatter_tensor: block r of the sum
  auto rs = torch::empty({10}, cuda);
  pg->reduce_scatter_tensor(rs, input(r, 10 * n).to(torch::kCUDA))->wait();
  at::Tensor expect = torch::zeros({10 * n});
  for (int k = 0; k < n; ++k) expect += input(k, 10 * n);
  EXPECT_TRUE(torch::equal(rs.cpu(), expect.narrow(0, 10 * r, 10)));
  // alltoall_base, equal splits
  auto a_out = torch::empty({4 * n}, cuda);
  pg->alltoall_base(a_out, input(r, 4 * n).to(torch::kCUDA), {}, {})->wait();
  for (int k = 0; k < n; ++k) {
    EXPECT_TRUE(torch::equal(a_out.narrow(0, 4 * k, 4).cpu(), input(k, 4 * n).narrow(0, 4 * r, 4)));
  }
  // gather and scatter to and from the last rank
  std::vector<at::Tensor> g;
  if (r == n - 1) {
    for (int k = 0; k < n; ++k) g.push_back(torch::empty({9}, cuda));
  }
  GatherOptions go;
  go.root = n - 1;
  pg->gather(g, input(r, 9).to(torch::kCUDA), go)->wait();
  for (int k = 0; k < static_cast<int>(g.size()); ++k) EXPECT_TRUE(torch::equal(g[k].cpu(), input(k, 9)));
  std::vector<at::Tensor> s;
  if (r == n - 1) {
    for (int k = 0; k < n; ++k) s.push_back(input(k, 6).to(torch::kCUDA));
  }
  auto s_out = torch::empty({6}, cuda);
  ScatterOptions so;
  so.root = n - 1;
  pg->scatter(s_out, s, so)->wait();
  EXPECT_TRUE(torch::equal(s_out.cpu(), input(r, 6)));
  // send/recv around the ring, a CUDA tensor one way and a CPU tensor the other
  auto to = (r + 1) % n, from = (r + n - 1) % n;
  auto got = torch::empty({50}, cuda);
  auto rw = pg->recv(got, from);
  pg->send(input(r, 50).to(torch::kCUDA), to)->wait();
  rw->wait();
  EXPECT_TRUE(torch::equal(got.cpu(), input(from, 50)));
  // 4 MiB messages: through host memory window by window (Note [Staged messages]), received
  // into a contiguous tensor and into a strided one (through a stand-in)
  {
    const int64_t len = int64_t(1) << 20;
    auto whole = torch::empty({len}, cuda);
    auto wide = torch::zeros({len, 2}, cuda);
    auto r1 = pg->recv(whole, from, /*tag=*/3);
    auto r2 = pg->recv(wide.select(1, 1), from, /*tag=*/4);
    auto sent = input(r, len).to(torch::kCUDA);
    pg->send(sent, to, 3)->wait();
    pg->send(sent, to, 4)->wait();
    r1->wait();
    r2->wait();
    EXPECT_TRUE(torch::equal(whole.cpu(), input(from, len))) << "4 MiB message";
    EXPECT_TRUE(torch::equal(wide.select(1, 1).cpu(), input(from, len))) << "strided message";
    EXPECT_TRUE(torch::equal(wide.select(1, 0).cpu(), torch::zeros({len})));
  }
  // allreduce_coalesced
  std::vector<at::Tensor> parts{input(r, 5).to(torch::kCUDA), input(r, 7).to(torch::kCUDA)};
  pg->allreduce_coalesced(parts)->wait();
  at::Tensor s5 = torch::zeros({5}), s7 = torch::zeros({7});
  for (int k = 0; k < n; ++k) {
    s5 += input(k, 5);
    s7 += input(k, 7);
  }
  EXPECT_TRUE(torch::equal(parts[0].cpu(), s5));
  EXPECT_TRUE(torch::equal(parts[1].cpu(), s7));
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
      SCOPED_TRACE(str("TDIST_STAGING_PIECE_BYTES=", piece, ", window ", window, ", ", algo,
                       ", world ", n));
      const size_t before = detail::staged_buffers_for_tests();
      spawn(n, [&](int rank, std::shared_ptr<Store> store) {
        c10::DeviceGuard on(c10::Device(c10::kCUDA, 0));
        check_ops_on_cuda(create_process_group(store, rank, n, ring_options()));
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
    EXPECT_TRUE(torch::equal(gathered.cpu(), torch::cat({torch::full({len}, 1.0),
                                                          torch::full({len}, 2.0)})))
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
    pg->allreduce(x)->future()->then([&](Future& f) {
      ran = true;
      return f.value();
    })->wait();
    EXPECT_TRUE(ran.load());
  });
}

}  // namespace
}  // namespace tdist::comm
