#pragma once
// One run of every operation of a process group, checked element by element (the GPU tests and
// the staging tests share it, so that the CPU tests run what the GPU ones run).

#include <torch/torch.h>

#include <memory>
#include <vector>

#include "tdist/comm/process_group.h"
#include "tests/comm/comm_test_util.h"

namespace tdist::comm::test {

// Every operation of the ring backend on tensors of `dev`, each rank's input depending on its rank
// and each element's position, against the same operation computed here on CPU tensors. Large
// enough for overlapped staging with the default pieces (1 MiB), and with windows of 3 MiB for
// several windows per operation (Note [Windows]). The GPU tests run it on CUDA tensors of ranks
// sharing one GPU; the staging tests on CPU tensors staged through the testing hook.
inline void check_every_op(const std::shared_ptr<ProcessGroup>& pg, c10::Device dev) {
  const int r = pg->rank(), n = pg->size();
  const auto on = torch::TensorOptions().device(dev);
  auto input = [&](int rank, int64_t len) {
    return torch::arange(len, torch::kFloat) + rank * 100;
  };
  // allreduce, every op on floats and ints, and a non-contiguous tensor.
  for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX, ReduceOp::MIN}) {
    auto x = input(r, 1000).to(dev);
    AllreduceOptions ao;
    ao.op = op;
    pg->allreduce(x, ao)->wait();
    std::vector<at::Tensor> all;
    for (int k = 0; k < n; ++k) all.push_back(input(k, 1000));
    EXPECT_EQ(x.device(), dev);
    EXPECT_TRUE(torch::allclose(x.cpu(), test::reference(all, op))) << to_string(op);
  }
  // Large enough for overlapped staging (Note [Overlapped staging]): written by a kernel queued
  // just before the call (the copies in wait for it on the same stream).
  for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG}) {
    auto base = torch::arange(int64_t(3) << 20, torch::kFloat).remainder(1000);  // 12 MiB
    auto big = base.to(dev, /*non_blocking=*/false, /*copy=*/true);  // base stays as it is
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
    auto wide = torch::zeros({base.numel(), 2}, on);
    auto col = wide.select(1, 0);
    col.copy_(base.to(dev)).mul_(r + 1);
    pg->allreduce(col)->wait();
    const auto want = base * (n * (n + 1) / 2);
    EXPECT_TRUE(torch::equal(col.cpu(), want)) << "strided allreduce";
    std::vector<at::Tensor> strided_outs, wides;
    for (int k = 0; k < n; ++k) {
      wides.push_back(torch::zeros({base.numel(), 2}, on));
      strided_outs.push_back(wides.back().select(1, 1));
    }
    pg->allgather(strided_outs, col)->wait();
    for (int k = 0; k < n; ++k) {
      EXPECT_TRUE(torch::equal(strided_outs[k].cpu(), want)) << "strided allgather " << k;
      EXPECT_TRUE(torch::equal(wides[k].select(1, 0).cpu(), torch::zeros_like(base)));
    }
    EXPECT_TRUE(torch::equal(wide.select(1, 1).cpu(), torch::zeros_like(base)));
  }
  auto ints = torch::full({3, 5}, r + 1, torch::kInt).to(dev).t();  // non-contiguous
  pg->allreduce(ints)->wait();
  EXPECT_TRUE(torch::equal(ints.cpu(), torch::full({5, 3}, n * (n + 1) / 2, torch::kInt)));
  // broadcast
  auto b = input(r, 77).to(dev);
  BroadcastOptions bo;
  bo.root = n - 1;
  pg->broadcast(b, bo)->wait();
  EXPECT_TRUE(torch::equal(b.cpu(), input(n - 1, 77)));
  // allgather and allgather_into_tensor
  std::vector<at::Tensor> outs;
  for (int k = 0; k < n; ++k) outs.push_back(torch::empty({33}, on));
  pg->allgather(outs, input(r, 33).to(dev))->wait();
  auto flat = torch::empty({33 * n}, on);
  pg->allgather_into_tensor(flat, input(r, 33).to(dev))->wait();
  for (int k = 0; k < n; ++k) {
    EXPECT_TRUE(torch::equal(outs[k].cpu(), input(k, 33)));
    EXPECT_TRUE(torch::equal(flat.narrow(0, 33 * k, 33).cpu(), input(k, 33)));
  }
  // Large enough for overlapped staging: allgather into staged outputs and reduce-scatter from
  // staged inputs, the tensor and the list forms; a broadcast and a reduce.
  {
    const int64_t len = int64_t(1) << 20;  // 4 MiB per rank
    auto big = r == 0 ? input(0, len).to(dev) : torch::zeros({len}, on);
    pg->broadcast(big)->wait();
    EXPECT_TRUE(torch::equal(big.cpu(), input(0, len)));
    auto reduced = input(r, len).to(dev);
    ReduceOptions ro;
    ro.root = n - 1;
    pg->reduce(reduced, ro)->wait();
    at::Tensor reduced_want = torch::zeros({len});
    for (int k = 0; k < n; ++k) reduced_want += input(k, len);
    EXPECT_TRUE(torch::equal(reduced.cpu(), r == n - 1 ? reduced_want : input(r, len)));
    auto gathered = torch::empty({len * n}, on);
    pg->allgather_into_tensor(gathered, input(r, len).to(dev))->wait();
    std::vector<at::Tensor> gathered_list;
    for (int k = 0; k < n; ++k) gathered_list.push_back(torch::empty({len}, on));
    pg->allgather(gathered_list, input(r, len).to(dev))->wait();
    auto rs_in = input(r, len * n).to(dev);
    auto rs_out = torch::empty({len}, on);
    pg->reduce_scatter_tensor(rs_out, rs_in)->wait();
    auto rs_out_list = torch::empty({len}, on);
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
    std::vector<at::Tensor> big_parts{input(r, len).to(dev), input(r, len / 2 + 3).to(dev)};
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
        g_big.push_back(torch::empty({len}, on));
        s_big.push_back(input(k + n, len).to(dev));
      }
    }
    GatherOptions go;
    go.root = n - 1;
    pg->gather(g_big, input(r, len).to(dev), go)->wait();
    for (int k = 0; k < static_cast<int>(g_big.size()); ++k) {
      EXPECT_TRUE(torch::equal(g_big[k].cpu(), input(k, len))) << "gather, block " << k;
    }
    ScatterOptions so;
    so.root = n - 1;
    auto scattered = torch::empty({len}, on);
    pg->scatter(scattered, s_big, so)->wait();
    EXPECT_TRUE(torch::equal(scattered.cpu(), input(r + n, len))) << "scatter";
    auto a_big = torch::empty({len * n}, on);
    pg->alltoall_base(a_big, input(r, len * n).to(dev), {}, {})->wait();
    for (int k = 0; k < n; ++k) {
      EXPECT_TRUE(torch::equal(a_big.narrow(0, len * k, len).cpu(),
                               input(k, len * n).narrow(0, len * r, len)))
          << "alltoall_base, block " << k;
    }
  }
  // reduce_scatter_tensor: block r of the sum
  auto rs = torch::empty({10}, on);
  pg->reduce_scatter_tensor(rs, input(r, 10 * n).to(dev))->wait();
  at::Tensor expect = torch::zeros({10 * n});
  for (int k = 0; k < n; ++k) expect += input(k, 10 * n);
  EXPECT_TRUE(torch::equal(rs.cpu(), expect.narrow(0, 10 * r, 10)));
  // alltoall_base, equal splits
  auto a_out = torch::empty({4 * n}, on);
  pg->alltoall_base(a_out, input(r, 4 * n).to(dev), {}, {})->wait();
  for (int k = 0; k < n; ++k) {
    EXPECT_TRUE(torch::equal(a_out.narrow(0, 4 * k, 4).cpu(), input(k, 4 * n).narrow(0, 4 * r, 4)));
  }
  // gather and scatter to and from the last rank
  std::vector<at::Tensor> g;
  if (r == n - 1) {
    for (int k = 0; k < n; ++k) g.push_back(torch::empty({9}, on));
  }
  GatherOptions go;
  go.root = n - 1;
  pg->gather(g, input(r, 9).to(dev), go)->wait();
  for (int k = 0; k < static_cast<int>(g.size()); ++k)
    EXPECT_TRUE(torch::equal(g[k].cpu(), input(k, 9)));
  std::vector<at::Tensor> s;
  if (r == n - 1) {
    for (int k = 0; k < n; ++k) s.push_back(input(k, 6).to(dev));
  }
  auto s_out = torch::empty({6}, on);
  ScatterOptions so;
  so.root = n - 1;
  pg->scatter(s_out, s, so)->wait();
  EXPECT_TRUE(torch::equal(s_out.cpu(), input(r, 6)));
  // send/recv around the ring
  auto to = (r + 1) % n, from = (r + n - 1) % n;
  auto got = torch::empty({50}, on);
  auto rw = pg->recv(got, from);
  pg->send(input(r, 50).to(dev), to)->wait();
  rw->wait();
  EXPECT_TRUE(torch::equal(got.cpu(), input(from, 50)));
  // 4 MiB messages: through host memory window by window (Note [Staged messages]), received
  // into a contiguous tensor and into a strided one (through a stand-in)
  {
    const int64_t len = int64_t(1) << 20;
    auto whole = torch::empty({len}, on);
    auto wide = torch::zeros({len, 2}, on);
    auto r1 = pg->recv(whole, from, /*tag=*/3);
    auto r2 = pg->recv(wide.select(1, 1), from, /*tag=*/4);
    auto sent = input(r, len).to(dev);
    pg->send(sent, to, 3)->wait();
    pg->send(sent, to, 4)->wait();
    r1->wait();
    r2->wait();
    EXPECT_TRUE(torch::equal(whole.cpu(), input(from, len))) << "4 MiB message";
    EXPECT_TRUE(torch::equal(wide.select(1, 1).cpu(), input(from, len))) << "strided message";
    EXPECT_TRUE(torch::equal(wide.select(1, 0).cpu(), torch::zeros({len})));
  }
  // allreduce_coalesced
  std::vector<at::Tensor> parts{input(r, 5).to(dev), input(r, 7).to(dev)};
  pg->allreduce_coalesced(parts)->wait();
  at::Tensor s5 = torch::zeros({5}), s7 = torch::zeros({7});
  for (int k = 0; k < n; ++k) {
    s5 += input(k, 5);
    s7 += input(k, 7);
  }
  EXPECT_TRUE(torch::equal(parts[0].cpu(), s5));
  EXPECT_TRUE(torch::equal(parts[1].cpu(), s7));
}

}  // namespace tdist::comm::test
