// Symmetric memory (Note [Symmetric memory] in comm/ring/symmetric_memory.cpp): real processes
// that map each other's buffers, and ranks that are threads of one process (plain memory).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <iostream>
#include <string>
#include <thread>

#include "tdist/comm/ring/ring_process_group.h"
#include "tdist/core/env.h"
#include "tdist/core/tcp_store.h"
#include "tests/comm/comm_test_util.h"
#include "tests/harness/proc_counts.h"
#include "tests/harness/process.h"

namespace tdist::comm {
namespace {

using ::tdist::test::symmetric_mappings;

// Every rank's value r + i at element i, reduced by `op` over `world` ranks.
at::Tensor want(int64_t n, int world, ReduceOp op) {
  const auto base = torch::arange(n, torch::kDouble);
  return op == ReduceOp::SUM   ? base * world + world * (world - 1) / 2.0
         : op == ReduceOp::AVG ? base + (world - 1) / 2.0
                               : base + (world - 1);
}

// Processes of one host. Checks, with the number of mismatches as the exit code (each printed):
//   - one buffer maps once read-write (this rank's) and world - 1 times read-only (its peers');
//   - an allreduce of a symmetric buffer and of slices of one at different offsets on each
//     rank, odd sizes, SUM, AVG and MAX, is right and moves no values through the channels
//     (three sends per peer of descriptors and meeting bytes, no forwarded hop), where the ring
//     would send the buffer;
//   - one rank passing plain memory, or the ranks passing different buffers, runs the ring, right;
//   - a broadcast from every root and an allgather (in place, and from a plain input into a
//     symmetric output) copy straight from the peers' buffers, right, and move values again when
//     one rank's buffer is plain;
//   - a reduce-scatter of a symmetric input (into a plain output, in place, as a list of its
//     blocks) reduces straight from the peers' inputs, right, and moves values again when one
//     rank's input is plain or the output lies over a block the peers read;
//   - ranks asking for different sizes all fail, naming the sizes, and the group stays usable;
//   - freeing a buffer unmaps it here once nothing uses it, and a buffer outlives its group.
TDIST_TEST_CHILD(comm_symmetric_child) {
  torch::set_num_threads(1);
  auto port = static_cast<uint16_t>(env::require_int("TDIST_TEST_STORE_PORT", 1, 65535));
  auto store = std::make_shared<TCPStore>("127.0.0.1", port, false, Millis(60000));
  auto pg = create_process_group(store, rank, world_size, test::test_options());
  auto* ring = dynamic_cast<detail::RingProcessGroup*>(pg.get());
  if (ring == nullptr) return 30;
  if (ring->single_copy_bytes() == detail::RingProcessGroup::kNoSingleCopy) {
    std::cerr << "rank " << rank << ": the group does not read its peers here" << std::endl;
    return 31;
  }
  int bad = 0;
  auto check = [&](bool ok, const std::string& what) {
    if (!ok) {
      std::cerr << "rank " << rank << ": " << what << std::endl;
      ++bad;
    }
  };
  const auto peers = static_cast<uint64_t>(world_size - 1);
  // Whether the last operation read the peers' buffers where they lie: one send of descriptors
  // and `meetings` one-byte meetings to each peer, nothing forwarded, no values. Every other
  // path sends more: the ring its values, the single copy (whose process_vm_readv these counts
  // do not see) its addresses after the descriptors.
  auto mapped = [&](uint64_t meetings) {
    const auto c = ring->last_counts();
    return c.forwards == 0 && c.sends == (1 + meetings) * peers && c.bytes_sent < 64 * peers &&
           c.bytes_received < 64 * peers;
  };
  auto allreduce_mapped = [&] { return mapped(2); };  // it meets twice
  constexpr int64_t n = 300001;      // larger than the small allreduce, not a multiple of the world
  constexpr int64_t block = 100003;  // an allgather's and a reduce-scatter's block, odd too
  {
    at::Tensor x = pg->symmetric_empty({n}, torch::kDouble);
    check(symmetric_mappings() == std::make_pair(1, world_size - 1),
          "one buffer is not mapped once read-write and once read-only per peer");
    for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX}) {
      x.copy_(torch::arange(n, torch::kDouble) + rank);
      AllreduceOptions o;
      o.op = op;
      pg->allreduce(x, o)->wait();
      check(torch::allclose(x, want(n, world_size, op)), str("wrong allreduce, op ", int(op)));
      check(allreduce_mapped(), "the allreduce of a symmetric buffer did not read the peers'");
    }
    at::Tensor big = pg->symmetric_empty({2 * n}, torch::kDouble);
    at::Tensor slice = big.narrow(0, 7 * rank + 3, n);
    slice.copy_(torch::arange(n, torch::kDouble) + rank);
    pg->allreduce(slice)->wait();
    check(torch::allclose(slice, want(n, world_size, ReduceOp::SUM)), "wrong sliced allreduce");
    check(allreduce_mapped(),
          "an allreduce of slices at different offsets did not read the peers'");

    at::Tensor plain = torch::empty({n}, torch::kDouble);
    at::Tensor mixed = rank == 0 ? plain : x;
    mixed.copy_(torch::arange(n, torch::kDouble) + rank);
    pg->allreduce(mixed)->wait();
    check(torch::allclose(mixed, want(n, world_size, ReduceOp::SUM)), "wrong mixed allreduce");
    check(!allreduce_mapped(), "an allreduce with plain memory on rank 0 read the peers' buffers");

    at::Tensor other = (rank == 0 ? big : x).narrow(0, 0, n);
    other.copy_(torch::arange(n, torch::kDouble) + rank);
    pg->allreduce(other)->wait();
    check(torch::allclose(other, want(n, world_size, ReduceOp::SUM)),
          "wrong allreduce of different buffers");
    check(!allreduce_mapped(), "an allreduce of different buffers read the peers' buffers");
  }
  {
    // A broadcast from each root, and an allgather in place and into a symmetric output from a
    // plain input, of symmetric buffers: right, and no values through the channels (one meeting
    // after the descriptors); with the root's or one rank's output in plain memory they move.
    at::Tensor x = pg->symmetric_empty({n}, torch::kDouble);
    at::Tensor plain = torch::empty({n}, torch::kDouble);
    const auto values = torch::arange(n, torch::kDouble);
    for (int root = 0; root < world_size; ++root) {
      for (bool all_symmetric : {true, false}) {
        at::Tensor b = all_symmetric || rank != root ? x : plain;
        b.copy_(values + (rank == root ? 0 : 7));
        BroadcastOptions o;
        o.root = root;
        pg->broadcast(b, o)->wait();
        check(torch::equal(b, values), str("wrong broadcast from root ", root));
        check(mapped(1) == all_symmetric,
              str("the broadcast from root ", root, all_symmetric ? " did not read" : " read",
                  " the root's buffer where it lies"));
      }
    }
    at::Tensor out = pg->symmetric_empty({block * world_size}, torch::kDouble);
    auto gathered = torch::cat([&] {
      std::vector<at::Tensor> parts;
      for (int p = 0; p < world_size; ++p)
        parts.push_back(torch::arange(block, torch::kDouble) + 10 * p);
      return parts;
    }());
    at::Tensor mine = out.narrow(0, rank * block, block);
    out.fill_(-1);
    mine.copy_(torch::arange(block, torch::kDouble) + 10 * rank);
    pg->allgather_into_tensor(out, mine)->wait();
    check(torch::equal(out, gathered), "wrong allgather in place");
    check(mapped(1), "the allgather in place did not read the peers' outputs");
    at::Tensor input = torch::arange(block, torch::kDouble) + 10 * rank;
    out.fill_(-1);
    pg->allgather_into_tensor(out, input)->wait();
    check(torch::equal(out, gathered), "wrong allgather of a plain input");
    check(mapped(1), "the allgather of a plain input did not read the peers' outputs");
    at::Tensor plain_out = torch::empty({block * world_size}, torch::kDouble);
    at::Tensor into = rank == world_size - 1 ? plain_out : out;
    into.fill_(-1);
    pg->allgather_into_tensor(into, input)->wait();
    check(torch::equal(into, gathered), "wrong allgather with one plain output");
    check(!mapped(1), "an allgather with a plain output read the peers' outputs");
  }
  {
    // A reduce-scatter of a symmetric input, into a plain output, in place and as a list of the
    // input's blocks: right, and no values through the channels (one meeting after the
    // descriptors); with one rank's input plain, or an output over a block the peers read, the
    // ring runs.
    at::Tensor in = pg->symmetric_empty({block * world_size}, torch::kDouble);
    at::Tensor plain_in = torch::empty({block * world_size}, torch::kDouble);
    at::Tensor out = torch::empty({block}, torch::kDouble);
    const auto values = torch::arange(block * world_size, torch::kDouble) + rank;
    auto mine = [&](ReduceOp op) {
      return want(block * world_size, world_size, op).narrow(0, rank * block, block);
    };
    for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX}) {
      in.copy_(values);
      ReduceScatterOptions o;
      o.op = op;
      pg->reduce_scatter_tensor(out, in, o)->wait();
      check(torch::allclose(out, mine(op)), str("wrong reduce_scatter, op ", int(op)));
      check(mapped(1), "the reduce_scatter of a symmetric input did not read the peers'");
    }
    in.copy_(values);
    at::Tensor own = in.narrow(0, rank * block, block);
    pg->reduce_scatter_tensor(own, in)->wait();
    check(torch::allclose(own, mine(ReduceOp::SUM)), "wrong reduce_scatter in place");
    check(mapped(1), "the reduce_scatter in place did not read the peers' inputs");
    in.copy_(values);
    pg->reduce_scatter(out, in.chunk(world_size))->wait();
    check(torch::allclose(out, mine(ReduceOp::SUM)), "wrong reduce_scatter of a list");
    check(mapped(1), "the reduce_scatter of the input's blocks did not read the peers' inputs");
    at::Tensor mixed = rank == 0 ? plain_in : in;
    mixed.copy_(values);
    pg->reduce_scatter_tensor(out, mixed)->wait();
    check(torch::allclose(out, mine(ReduceOp::SUM)), "wrong reduce_scatter of a plain input");
    check(!mapped(1), "a reduce_scatter with a plain input on rank 0 read the peers' inputs");
    // (What lands there is the ring's business: only the path is checked.)
    in.copy_(values);
    pg->reduce_scatter_tensor(in.narrow(0, (rank + 1) % world_size * block, block), in)->wait();
    check(!mapped(1), "a reduce_scatter into a block its peers read took the mapped path");
  }
  // The worker thread that ran the last operation may still hold its result (the output tensor)
  // for a moment after the caller's wait() returned: the buffers go once it lets go.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (symmetric_mappings() != std::make_pair(0, 0) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  check(symmetric_mappings() == std::make_pair(0, 0), "freed buffers are still mapped after 10 s");

  try {
    pg->symmetric_empty({rank == 0 ? 100 : 100000}, torch::kDouble);
    check(false, "symmetric buffers of different sizes did not fail");
  } catch (const std::exception& e) {
    check(std::string(e.what()).find("bytes of symmetric memory") != std::string::npos,
          str("unexpected error: ", e.what()));
  }
  auto after = torch::ones({5}, torch::kDouble);
  pg->allreduce(after)->wait();
  check(torch::equal(after, torch::full({5}, double(world_size), torch::kDouble)),
        "wrong allreduce after the mismatch");

  at::Tensor kept = pg->symmetric_empty({1000}, torch::kFloat);
  pg->barrier()->wait();
  pg.reset();
  kept.fill_(2.5f);
  check(kept.sum().item<float>() == 2500.0f, "a buffer that outlived its group lost its memory");
  return bad;
}

class SymmetricMemoryProcesses : public ::testing::TestWithParam<int> {};

TEST_P(SymmetricMemoryProcesses, CollectivesReadThePeersBuffersAndFallBackTogether) {
  TCPStoreServer server("127.0.0.1", 0);
  tdist::test::Processes procs(
      "comm_symmetric_child", GetParam(),
      {{"TDIST_TEST_STORE_PORT", std::to_string(server.port())}, {"TDIST_TRANSPORT", "auto"}});
  auto results = procs.wait_all(Millis(90000));
  EXPECT_EQ(tdist::test::Processes::failures(results), "");
}

INSTANTIATE_TEST_SUITE_P(Worlds, SymmetricMemoryProcesses, ::testing::Values(2, 3));

// Ranks that are threads of one process never map each other (Note [Single-copy collectives]):
// symmetric_empty gives plain memory and the allreduce is the ring's.
TEST(SymmetricMemory, ThreadsGetPlainMemory) {
  tdist::test::spawn(2, [](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 2, test::test_options());
    at::Tensor x = pg->symmetric_empty({3, 40000}, torch::kDouble);
    ASSERT_EQ(x.sizes(), (std::vector<int64_t>{3, 40000}));
    ASSERT_EQ(x.scalar_type(), torch::kDouble);
    EXPECT_EQ(symmetric_mappings(), std::make_pair(0, 0));
    x.copy_(torch::arange(x.numel(), torch::kDouble).view({3, 40000}) + rank);
    pg->allreduce(x)->wait();
    EXPECT_TRUE(torch::allclose(x.view({-1}), want(x.numel(), 2, ReduceOp::SUM)));
    EXPECT_THROW(pg->symmetric_empty({-1}, torch::kFloat), InvalidArgument);
  });
}

}  // namespace
}  // namespace tdist::comm
