// Overlapped staging (Note [Overlapped staging] in comm/algorithms/overlapped_staging.h) without a GPU: the testing hook
// stages CPU tensors through a copy thread that fills the host buffer piece by piece, late, over
// a buffer that starts as garbage (0xff bytes: NaN, -1), and copies results out as the algorithm
// finishes them. A transfer that ran ahead of its piece shows in the results; a part finished
// twice (once before it was final) or never fails the operation (the hook's engine checks that
// every byte was finished exactly once).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <optional>
#include <thread>
#include <torch/torch.h>

#include "tdist/comm/ring/staging.h"
#include "tests/comm/comm_test_util.h"
#include "tests/comm/cpu_staging.h"

namespace tdist::comm {
namespace {

namespace algo = tdist::comm::algorithms;

// Parameters: world size and transport.
class OverlappedStaging : public ::testing::TestWithParam<std::tuple<int, const char*>> {
 protected:
  int world() const { return std::get<0>(GetParam()); }
  std::string transport() const { return std::get<1>(GetParam()); }
};

// Every rank allreduces tensors of each length with the ring; `unstaged_rank` (if >= 0) passes
// a non-contiguous view, which is not staged, so it meets the staged ranks in one ring.
// `window_bytes` (0: the default) sets the allreduce window (Note [Windows]).
void check(int world, const std::string& transport, const std::string& algo, size_t chunk_bytes,
           size_t piece_bytes, int delay_us, const std::vector<int64_t>& lengths,
           int unstaged_rank = -1, size_t window_bytes = 0) {
  tdist::test::EnvGuard env(tdist::test::EnvVars{
      {"TDIST_TRANSPORT", transport},
      {"TDIST_ALLREDUCE_ALGO", algo},
      {"TDIST_CHUNK_BYTES", std::to_string(chunk_bytes)},
      {"TDIST_WINDOW_BYTES", window_bytes > 0
                                 ? std::optional<std::string>(std::to_string(window_bytes))
                                 : std::nullopt}});
  CpuStaging on(piece_bytes, delay_us);
  tdist::test::spawn(world, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, world, test::test_options());
    for (int64_t n : lengths) {
      for (auto t : {c10::ScalarType::Float, c10::ScalarType::Double, c10::ScalarType::Int}) {
        for (auto op : {ReduceOp::SUM, ReduceOp::MAX, ReduceOp::AVG}) {
          if (!test::op_supported(t, op)) continue;
          SCOPED_TRACE(str("n=", n, " ", c10::toString(t), " ", to_string(op)));
          at::Tensor x = test::make_input(t, op, n, rank);
          if (rank == unstaged_rank) x = x.reshape({2, n / 2}).t().contiguous().t();
          AllreduceOptions o;
          o.op = op;
          pg->allreduce(x, o)->wait();
          auto want = test::expected(t, op, n, world);
          if (rank == unstaged_rank) want = want.reshape({2, n / 2});
          ASSERT_TRUE(test::same(x, want)) << test::describe(x) << " vs " << test::describe(want);
        }
      }
    }
  });
}

// Pieces that split elements' worth of chunks unevenly (1000-byte pieces: 250 floats, 125
// doubles; 333- and 4096-byte chunks), each piece late, lengths that do not divide by the world.
TEST_P(OverlappedStaging, LatePiecesGiveExactResults) {
  for (size_t chunk : {333, 4096}) {
    SCOPED_TRACE(str("chunk ", chunk));
    check(world(), transport(), "ring", chunk, 1000, 200, {1000, 10006});
  }
}

// A rank that is not staged runs the same ring as the staged ones.
TEST_P(OverlappedStaging, AStagedAndAnUnstagedRankReduceTogether) {
  check(world(), transport(), "ring", 4096, 1000, 100, {10006}, /*unstaged_rank=*/0);
}

// Windows of 8000 bytes (Note [Windows]): each window a ring of its own, staged on its
// own, so no more than two windows per rank are in host memory at once, where the whole tensor is
// up to ten times a window (and 4001 elements end in a window of one, fewer than the ranks);
// staged ranks, an unstaged one and all-CPU rings (pieces of 0) run the same windows together.
TEST_P(OverlappedStaging, WindowsBoundTheStagedMemory) {
  const size_t window = 8000;
  const size_t staged_before = detail::staged_buffers_for_tests();
  detail::reset_staged_peak_for_tests();
  check(world(), transport(), "ring", 333, 1000, 20, {2000, 10006, 4001}, -1, window);
  EXPECT_LE(detail::staged_peak_bytes_for_tests(), static_cast<size_t>(world()) * 2 * window);
  // One staged buffer per window: check() reduces floats and doubles with 3 ops, ints with 2.
  size_t windows = 0;
  for (size_t n : {2000, 10006, 4001}) {
    for (auto [elem, ops] : {std::pair<size_t, size_t>{4, 3}, {8, 3}, {4, 2}}) {
      windows += ops * ((n + window / elem - 1) / (window / elem));
    }
  }
  EXPECT_EQ(detail::staged_buffers_for_tests() - staged_before, world() * windows);
  check(world(), transport(), "ring", 4096, 1000, 20, {10006}, /*unstaged_rank=*/0, window);
  check(world(), transport(), "ring", 333, 0, 0, {10006}, -1, window);
}

// Recursive doubling (chosen by TDIST_ALLREDUCE_ALGO) in windows of 8000 bytes: each window
// staged on its own and exchanged once all of it arrived, no more than two in host memory at
// once; an unstaged rank and all-CPU groups (pieces of 0) run the same windows.
TEST_P(OverlappedStaging, RecursiveDoublingInWindows) {
  const size_t window = 8000;
  const size_t staged_before = detail::staged_buffers_for_tests();
  detail::reset_staged_peak_for_tests();
  check(world(), transport(), "recursive_doubling", 333, 1000, 20, {10006}, -1, window);
  EXPECT_LE(detail::staged_peak_bytes_for_tests(), static_cast<size_t>(world()) * 2 * window);
  size_t windows = 0;  // floats and doubles with 3 ops, ints with 2
  for (auto [elem, ops] : {std::pair<size_t, size_t>{4, 3}, {8, 3}, {4, 2}}) {
    windows += ops * ((10006 + window / elem - 1) / (window / elem));
  }
  EXPECT_EQ(detail::staged_buffers_for_tests() - staged_before, world() * windows);
  check(world(), transport(), "recursive_doubling", 4096, 1000, 20, {10006}, 0, window);
  check(world(), transport(), "recursive_doubling", 333, 0, 0, {10006}, -1, window);
}

// The defaults (1 MiB pieces, 256 KiB chunks, the automatic algorithm choice) on buffers that
// the ring serves.
TEST_P(OverlappedStaging, DefaultPiecesAndChunks) {
  check(world(), transport(), "auto", 256 * 1024, detail::StagedTensors::kPieceBytes, 0,
        {(int64_t(5) << 20) / 4 + 6});
}

// allreduce_coalesced: the tensors staged as one buffer, reduced as if concatenated, each part
// copied back into its own tensor; with the default window, and with windows of 8000 bytes that
// cut across the tensors (64 KB in all: nine windows).
TEST_P(OverlappedStaging, AllreduceCoalescedOfStagedTensors) {
  for (const char* window : {"67108864", "8000"}) {
    SCOPED_TRACE(str("window ", window));
    tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_TRANSPORT", transport()},
                                                   {"TDIST_ALLREDUCE_ALGO", "ring"},
                                                   {"TDIST_CHUNK_BYTES", "333"},
                                                   {"TDIST_WINDOW_BYTES", window}});
    CpuStaging on(1000, 50);
    const int w = world();
    const std::vector<int64_t> lengths{1001, 3, 7000};
    tdist::test::spawn(w, [&](int rank, std::shared_ptr<Store> store) {
      auto pg = create_process_group(store, rank, w, test::test_options());
      for (auto op : {ReduceOp::SUM, ReduceOp::AVG}) {
        std::vector<at::Tensor> xs;
        for (size_t i = 0; i < lengths.size(); ++i) {
          xs.push_back(test::make_input(c10::ScalarType::Double, op, lengths[i], rank, int(i)));
        }
        AllreduceCoalescedOptions o;
        o.op = op;
        pg->allreduce_coalesced(xs, o)->wait();
        for (size_t i = 0; i < lengths.size(); ++i) {
          auto want = test::expected(c10::ScalarType::Double, op, lengths[i], w, int(i));
          ASSERT_TRUE(test::same(xs[i], want))
              << to_string(op) << " tensor " << i << ": " << test::describe(xs[i]);
        }
      }
    });
  }
}

// allgather_into_tensor (in place and not) and allgather of n doubles per rank into outputs made
// by fresh(length), each result checked.
void check_allgathers(ProcessGroup& pg, int rank, int64_t n,
                      const std::function<at::Tensor(int64_t)>& fresh) {
  const int w = pg.size();
  const auto want = torch::arange(n * w, torch::kDouble);
  for (bool in_place : {false, true}) {
    SCOPED_TRACE(in_place ? "allgather_into_tensor in place" : "allgather_into_tensor");
    at::Tensor out = fresh(n * w);
    at::Tensor in = want.narrow(0, rank * n, n).clone();
    if (in_place) {
      out.narrow(0, rank * n, n).copy_(in);
      in = out.narrow(0, rank * n, n);
    }
    pg.allgather_into_tensor(out, in)->wait();
    ASSERT_TRUE(torch::equal(out, want)) << test::describe(out);
  }
  std::vector<at::Tensor> outs;
  for (int r = 0; r < w; ++r) outs.push_back(fresh(n));
  pg.allgather(outs, want.narrow(0, rank * n, n).clone())->wait();
  ASSERT_TRUE(torch::equal(torch::cat(outs), want)) << "list form";
}

// allgather_into_tensor into a staged output (each block copied out as it lands): through the
// ring (single copy off) and by single copy where the group may read its peers (from world 3,
// and at world 2 where its set-up measured it faster), in place or not; and the list form, its
// outputs staged together.
TEST_P(OverlappedStaging, AllgatherIntoAStagedOutput) {
  for (const char* single : {"0", "1"}) {
    SCOPED_TRACE(str("TDIST_SINGLE_COPY=", single));
    tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_TRANSPORT", transport()},
                                                   {"TDIST_CHUNK_BYTES", "4096"},
                                                   {"TDIST_SINGLE_COPY", single},
                                                   {"TDIST_SINGLE_COPY_BYTES", "1024"}});
    CpuStaging on(1000, 50);
    const int w = world();
    tdist::test::spawn(w, [&](int rank, std::shared_ptr<Store> store) {
      auto pg = create_process_group(store, rank, w, test::test_options());
      for (int64_t n : {1001, 20000}) {
        SCOPED_TRACE(str("n=", n));
        check_allgathers(*pg, rank, n,
                         [](int64_t len) { return torch::full({len}, -7.0, torch::kDouble); });
      }
    });
  }
}

// reduce_scatter_tensor from a staged input (read piece by piece as the copies arrive), with
// chunks smaller and larger than a piece, in place or not; and the list form, its inputs staged
// together.
TEST_P(OverlappedStaging, ReduceScatterFromAStagedInput) {
  for (size_t chunk : {333, 4096}) {
    tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_TRANSPORT", transport()},
                                                   {"TDIST_CHUNK_BYTES", std::to_string(chunk)}});
    CpuStaging on(1000, 50);
    const int w = world();
    tdist::test::spawn(w, [&](int rank, std::shared_ptr<Store> store) {
      auto pg = create_process_group(store, rank, w, test::test_options());
      for (int64_t n : {1001, 7000}) {
        for (auto op : {ReduceOp::SUM, ReduceOp::MAX, ReduceOp::AVG}) {
          for (bool in_place : {false, true}) {
            SCOPED_TRACE(
                str("chunk ", chunk, " n=", n, " ", to_string(op), in_place ? " in place" : ""));
            auto x = test::make_input(c10::ScalarType::Double, op, n * w, rank);
            auto want =
                test::expected(c10::ScalarType::Double, op, n * w, w).narrow(0, rank * n, n);
            at::Tensor out =
                in_place ? x.narrow(0, rank * n, n) : torch::empty({n}, torch::kDouble);
            ReduceScatterOptions o;
            o.op = op;
            pg->reduce_scatter_tensor(out, x, o)->wait();
            ASSERT_TRUE(test::same(out, want))
                << test::describe(out) << " vs " << test::describe(want);
          }
          auto want = test::expected(c10::ScalarType::Double, op, n * w, w).narrow(0, rank * n, n);
          auto x2 = test::make_input(c10::ScalarType::Double, op, n * w, rank);
          std::vector<at::Tensor> ins;
          for (int b = 0; b < w; ++b) ins.push_back(x2.narrow(0, b * n, n).clone());
          auto out2 = torch::empty({n}, torch::kDouble);
          ReduceScatterOptions o;
          o.op = op;
          pg->reduce_scatter(out2, ins, o)->wait();
          ASSERT_TRUE(test::same(out2, want)) << "list form: " << test::describe(out2);
        }
      }
    });
  }
}

// Allgathers and reduce-scatters larger than a window (Note [Windows]): windows of 8000 bytes over
// blocks of 20000 doubles (40 to 80 windows), staged window by window, through the ring and by
// single copy, in place or not, tensor and list forms; with `unstaged` >= 0 that rank passes
// strided tensors, which are not staged but run the same windows. No rank holds more than two
// windows in host memory (a reduce-scatter's window holds its output's slice as well), where one
// operation's tensors are 20 to 80 windows; one staged buffer per window.
TEST_P(OverlappedStaging, AllgatherAndReduceScatterWindowsBoundTheStagedMemory) {
  const size_t window = 8000;
  const int w = world();
  const int64_t n = 20000;
  for (const char* single : {"0", "1"}) {
    for (int unstaged : {-1, w - 1}) {
      SCOPED_TRACE(str("TDIST_SINGLE_COPY=", single, " unstaged rank ", unstaged));
      tdist::test::EnvGuard env(
          tdist::test::EnvVars{{"TDIST_TRANSPORT", transport()},
                               {"TDIST_CHUNK_BYTES", "333"},
                               {"TDIST_SINGLE_COPY", single},
                               {"TDIST_SINGLE_COPY_BYTES", "1024"},
                               {"TDIST_WINDOW_BYTES", std::to_string(window)}});
      CpuStaging on(1000, 20);
      detail::reset_staged_peak_for_tests();
      const size_t before = detail::staged_buffers_for_tests();
      tdist::test::spawn(w, [&](int rank, std::shared_ptr<Store> store) {
        auto pg = create_process_group(store, rank, w, test::test_options());
        const bool strided = rank == unstaged;
        // n doubles, every second one of a larger tensor when strided.
        auto fresh = [&](int64_t len) {
          return strided ? torch::full({len, 2}, -7.0, torch::kDouble).select(1, 0)
                         : torch::full({len}, -7.0, torch::kDouble);
        };
        check_allgathers(*pg, rank, n, fresh);
        for (auto op : {ReduceOp::SUM, ReduceOp::AVG}) {
          SCOPED_TRACE(to_string(op));
          ReduceScatterOptions o;
          o.op = op;
          const auto x = test::make_input(c10::ScalarType::Double, op, n * w, rank);
          const auto sum =
              test::expected(c10::ScalarType::Double, op, n * w, w).narrow(0, rank * n, n);
          at::Tensor in = fresh(n * w);
          in.copy_(x);
          auto out = torch::empty({n}, torch::kDouble);
          pg->reduce_scatter_tensor(out, in, o)->wait();
          ASSERT_TRUE(test::same(out, sum)) << test::describe(out);
          std::vector<at::Tensor> ins;
          for (int b = 0; b < w; ++b) ins.push_back(x.narrow(0, b * n, n).clone());
          at::Tensor out2 = fresh(n);
          pg->reduce_scatter(out2, ins, o)->wait();
          ASSERT_TRUE(test::same(out2, sum)) << "list form: " << test::describe(out2);
        }
      });
      EXPECT_LE(detail::staged_peak_bytes_for_tests(), 2 * window * static_cast<size_t>(w + 1));
      // Per staged rank: three allgathers and four reduce-scatters, each window staged once.
      const size_t ag =
          (n * 8 + algo::block_window_bytes(window, w) - 1) / algo::block_window_bytes(window, w);
      const size_t e = algo::block_window_elems(window, w, 8);
      const size_t rs = (n + e - 1) / e;
      const size_t staged_ranks = static_cast<size_t>(w - (unstaged >= 0 ? 1 : 0));
      EXPECT_EQ(detail::staged_buffers_for_tests() - before, staged_ranks * (3 * ag + 4 * rs));
    }
  }
}

// A copy of `values` for a rank: contiguous (so staged), or on the unstaged rank a strided view
// (so copied in and out whole).
using Fresh = std::function<at::Tensor(const at::Tensor&)>;

// Runs body(rank, pg, fresh) on every rank of a group of `w` (threads) over `transport`, with
// windows of `window` bytes, chunks of 333 bytes and `env`, CPU tensors staged in pieces of 4000
// bytes, each 200 us late, except on rank `unstaged` (if >= 0; `fresh` there gives strided
// tensors). With `strided`, every rank's `fresh` gives strided tensors, which are staged through
// contiguous stand-ins (Note [Strided device tensors]). Resets the staged peak first; returns how
// many buffers were staged meanwhile.
size_t on_staged_ranks(int w, const std::string& transport, const char* window, int unstaged,
                       tdist::test::EnvVars env,
                       const std::function<void(int, ProcessGroup&, const Fresh&)>& body,
                       bool strided = false) {
  env["TDIST_TRANSPORT"] = transport;
  env["TDIST_CHUNK_BYTES"] = "333";
  env["TDIST_WINDOW_BYTES"] = window;
  tdist::test::EnvGuard guard(env);
  CpuStaging on(4000, 200, strided);
  detail::reset_staged_peak_for_tests();
  const size_t before = detail::staged_buffers_for_tests();
  tdist::test::spawn(w, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, w, test::test_options());
    const Fresh fresh = [&](const at::Tensor& values) {
      if (rank != unstaged && !strided) return values.clone();
      at::Tensor t = torch::empty({values.numel(), 2}, values.options()).select(1, 0);
      return t.copy_(values);
    };
    body(rank, *pg, fresh);
  });
  return detail::staged_buffers_for_tests() - before;
}

// Broadcasts and reduces from and to every root (Note [Windows]): the root's tensor staged in
// pieces, each late; the other ranks' broadcast copied out as it lands, their reduce inputs read
// as they arrive (however late) and left as they were; through the chain and (world 2) by single
// copy; with the default window and with windows of 8000 bytes (no rank holding more than two);
// with `unstaged` >= 0 that rank passes strided tensors, which run the same windows unstaged.
TEST_P(OverlappedStaging, BroadcastAndReduceOfStagedTensors) {
  const int w = world();
  const int64_t n = 10001;  // doubles: 80008 bytes, 11 windows of 8000 bytes
  for (const char* window : {"67108864", "8000"}) {
    for (const char* single : {"0", "1"}) {
      for (int unstaged : {-1, 0}) {
        SCOPED_TRACE(
            str("window ", window, " TDIST_SINGLE_COPY=", single, " unstaged rank ", unstaged));
        const tdist::test::EnvVars env{{"TDIST_SINGLE_COPY", single},
                                       {"TDIST_SINGLE_COPY_BYTES", "1024"}};
        const size_t staged = on_staged_ranks(
            w, transport(), window, unstaged, env,
            [&](int rank, ProcessGroup& pg, const Fresh& fresh) {
              for (int root = 0; root < w; ++root) {
                SCOPED_TRACE(str("root ", root));
                const auto want = torch::arange(n, torch::kDouble) * (root + 1);
                at::Tensor b = fresh(rank == root ? want : torch::full({n}, -7.0, torch::kDouble));
                BroadcastOptions bo;
                bo.root = root;
                pg.broadcast(b, bo)->wait();
                ASSERT_TRUE(torch::equal(b, want)) << "broadcast: " << test::describe(b);
                for (auto op : {ReduceOp::SUM, ReduceOp::MAX, ReduceOp::AVG}) {
                  SCOPED_TRACE(to_string(op));
                  const auto mine = test::make_input(c10::ScalarType::Double, op, n, rank);
                  at::Tensor x = fresh(mine);
                  ReduceOptions ro;
                  ro.root = root;
                  ro.op = op;
                  // The chain's first rank sends at once; the later ones' copies start later, so a
                  // partial sum that did not wait for them would meet garbage.
                  if (rank != (root + 1) % w)
                    std::this_thread::sleep_for(std::chrono::milliseconds(2));
                  pg.reduce(x, ro)->wait();
                  const auto expect =
                      rank == root ? test::expected(c10::ScalarType::Double, op, n, w) : mine;
                  ASSERT_TRUE(test::same(x, expect)) << "reduce: " << test::describe(x);
                }
              }
            });
        const size_t bytes = n * 8, win = std::stoul(window);
        EXPECT_LE(detail::staged_peak_bytes_for_tests(),
                  2 * std::min(win, bytes) * static_cast<size_t>(w));
        // Per staged rank and root: a broadcast and three reduces, each window staged once.
        const size_t windows = (bytes + win - 1) / win;
        const size_t staged_ranks = static_cast<size_t>(w - (unstaged >= 0 ? 1 : 0));
        EXPECT_EQ(staged, staged_ranks * w * 4 * windows);
      }
    }
  }
}

// Gathers and scatters to and from every root: what a rank sends waits for its pieces (the
// receives are posted before they arrive), the root copies each received chunk out as it lands
// and its own slice once arrived; with windows of 8000 bytes no rank holds more than two.
TEST_P(OverlappedStaging, GatherAndScatterOfStagedTensors) {
  const int w = world();
  const int64_t n = 10001;  // doubles: 80008 bytes a block, windows of 8000 / w bytes of each
  for (const char* window : {"67108864", "8000"}) {
    for (int unstaged : {-1, 0}) {
      SCOPED_TRACE(str("window ", window, " unstaged rank ", unstaged));
      const size_t staged =
          on_staged_ranks(w, transport(), window, unstaged, {},
                          [&](int rank, ProcessGroup& pg, const Fresh& fresh) {
                            auto block = [&](int of, int root) {
                              return torch::arange(n, torch::kDouble) * (of + 1) + root * 1000000;
                            };
                            const auto untouched = torch::full({n}, -7.0, torch::kDouble);
                            for (int root = 0; root < w; ++root) {
                              SCOPED_TRACE(str("root ", root));
                              std::vector<at::Tensor> outs, ins;
                              if (rank == root) {
                                for (int i = 0; i < w; ++i) {
                                  outs.push_back(fresh(untouched));
                                  ins.push_back(fresh(block(i, root) * -1));
                                }
                              }
                              GatherOptions go;
                              go.root = root;
                              // The root's receives are posted at once; the others' copies start later, so a send
                              // that did not wait for them would carry garbage.
                              if (rank != root)
                                std::this_thread::sleep_for(std::chrono::milliseconds(2));
                              pg.gather(outs, fresh(block(rank, root)), go)->wait();
                              for (int i = 0; i < static_cast<int>(outs.size()); ++i) {
                                ASSERT_TRUE(torch::equal(outs[i], block(i, root)))
                                    << "gather, block " << i << ": " << test::describe(outs[i]);
                              }
                              ScatterOptions so;
                              so.root = root;
                              at::Tensor out = fresh(untouched);
                              pg.scatter(out, ins, so)->wait();
                              ASSERT_TRUE(torch::equal(out, block(rank, root) * -1))
                                  << "scatter: " << test::describe(out);
                            }
                          });
      const size_t bytes = n * 8, win = std::stoul(window);
      // The root holds two windows of every rank's slice at most, the others two of their own.
      const size_t slice = std::min(algo::block_window_bytes(win, w), bytes);
      EXPECT_LE(detail::staged_peak_bytes_for_tests(), 2 * slice * static_cast<size_t>(2 * w - 1));
      // Per staged rank and root: a gather and a scatter, each window staged once.
      const size_t windows = (bytes + slice - 1) / slice;
      const size_t staged_ranks = static_cast<size_t>(w - (unstaged >= 0 ? 1 : 0));
      EXPECT_EQ(staged, staged_ranks * w * 2 * windows);
    }
  }
}

// Blocks of (s + 2d) % 4 * 3000 elements from rank s to rank d (some empty), valued by both.
int64_t alltoall_rows(int s, int d) { return (s + 2 * d) % 4 * 3000; }
at::Tensor alltoall_block(int s, int d) {
  return torch::arange(alltoall_rows(s, d), torch::kLong) + 1000000 * s + 100000 * d;
}

// Alltoalls of blocks of different sizes, some empty (list and flat forms): every pair's sends
// wait for their pieces, each received chunk is copied out as it lands; in windows of 8000 bytes
// of every block sent and received, the ranks' windows as many as their own longest block needs.
TEST_P(OverlappedStaging, AlltoallOfStagedTensors) {
  const int w = world();
  for (const char* window : {"67108864", "8000"}) {
    for (int unstaged : {-1, 0}) {
      SCOPED_TRACE(str("window ", window, " unstaged rank ", unstaged));
      const size_t staged = on_staged_ranks(
          w, transport(), window, unstaged, {},
          [&](int rank, ProcessGroup& pg, const Fresh& fresh) {
            std::vector<at::Tensor> ins, outs, want;
            std::vector<int64_t> in_splits, out_splits;
            for (int d = 0; d < w; ++d) {
              ins.push_back(fresh(alltoall_block(rank, d)));
              want.push_back(alltoall_block(d, rank));
              outs.push_back(fresh(torch::full({alltoall_rows(d, rank)}, -7, torch::kLong)));
              in_splits.push_back(alltoall_rows(rank, d));
              out_splits.push_back(alltoall_rows(d, rank));
            }
            // The others' copies start later, so a send that did not wait for them would carry
            // garbage.
            if (rank != 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
            pg.alltoall(outs, ins)->wait();
            for (int s = 0; s < w; ++s) {
              ASSERT_TRUE(torch::equal(outs[s], want[s]))
                  << "alltoall from " << s << ": " << test::describe(outs[s]);
            }
            at::Tensor out = fresh(torch::full({torch::cat(want).numel()}, -7, torch::kLong));
            pg.alltoall_base(out, fresh(torch::cat(ins)), out_splits, in_splits)->wait();
            ASSERT_TRUE(torch::equal(out, torch::cat(want)))
                << "alltoall_base: " << test::describe(out);
          });
      const size_t win = std::stoul(window);
      const size_t slice = algo::block_window_bytes(win, 2 * w);
      // A window holds a slice of every block sent and received: two windows per rank at most.
      size_t windows = 0, largest = 0;  // over the staged ranks
      for (int r = 0; r < w; ++r) {
        size_t longest = 0, bytes = 0;
        for (int d = 0; d < w; ++d) {
          const auto out = static_cast<size_t>(alltoall_rows(r, d)) * 8;
          const auto in = static_cast<size_t>(alltoall_rows(d, r)) * 8;
          longest = std::max({longest, out, in});
          bytes += out + in;
        }
        largest = std::max(largest, std::min(bytes, win));
        if (r != unstaged) windows += (longest + slice - 1) / slice;
      }
      EXPECT_LE(detail::staged_peak_bytes_for_tests(), 2 * largest * static_cast<size_t>(w));
      // Per staged rank, alltoall and alltoall_base, each window staged once.
      EXPECT_EQ(staged, 2 * windows);
    }
  }
}

// Every operation on strided tensors (and an allreduce of a negative view), staged through
// contiguous stand-ins on every rank (Note [Strided device tensors]): exact results written back
// into the caller's tensors, what is only read left as it was, and every operation staged window
// by window (without the stand-ins none would be staged: they would be copied whole).
TEST_P(OverlappedStaging, StridedTensorsStageThroughContiguousStandIns) {
  const int w = world();
  const int64_t n = 10001;  // doubles: 80008 bytes, windows of 8000 bytes
  const auto kD = torch::kDouble;
  int ops = 0;  // per rank, each staging at least one window
  const size_t staged = on_staged_ranks(
      w, transport(), "8000", -1, {},
      [&](int rank, ProcessGroup& pg, const Fresh& fresh) {
        auto count = [&] {
          if (rank == 0) ++ops;
        };
        const auto untouched = torch::full({n}, -7.0, kD);
        const auto mine = test::make_input(c10::ScalarType::Double, ReduceOp::SUM, n, rank);
        const auto sum = test::expected(c10::ScalarType::Double, ReduceOp::SUM, n, w);
        at::Tensor x = fresh(mine);
        ASSERT_FALSE(x.is_contiguous());
        pg.allreduce(x)->wait();
        count();
        ASSERT_TRUE(test::same(x, sum)) << "allreduce: " << test::describe(x);
        at::Tensor neg = at::_neg_view(mine.neg());
        pg.allreduce(neg)->wait();
        count();
        ASSERT_TRUE(neg.is_neg());
        ASSERT_TRUE(test::same(neg, sum))
            << "allreduce of a negative view: " << test::describe(neg);
        std::vector<at::Tensor> pair{fresh(mine), fresh(mine * 2)};
        pg.allreduce_coalesced(pair)->wait();
        count();
        ASSERT_TRUE(test::same(pair[0], sum) && test::same(pair[1], sum * 2)) << "coalesced";
        for (int root = 0; root < w; ++root) {
          SCOPED_TRACE(str("root ", root));
          const auto want = torch::arange(n, kD) * (root + 1);
          at::Tensor b = fresh(rank == root ? want : untouched);
          BroadcastOptions bo;
          bo.root = root;
          pg.broadcast(b, bo)->wait();
          count();
          ASSERT_TRUE(torch::equal(b, want)) << "broadcast: " << test::describe(b);
          at::Tensor r = fresh(mine);
          ReduceOptions ro;
          ro.root = root;
          pg.reduce(r, ro)->wait();
          count();
          ASSERT_TRUE(test::same(r, rank == root ? sum : mine)) << "reduce: " << test::describe(r);
        }
        auto block = [&](int of) { return torch::arange(n, kD) * (of + 1); };
        std::vector<at::Tensor> outs;
        for (int i = 0; i < w; ++i) outs.push_back(fresh(untouched));
        at::Tensor in = fresh(block(rank));
        pg.allgather(outs, in)->wait();
        count();
        for (int i = 0; i < w; ++i)
          ASSERT_TRUE(torch::equal(outs[i], block(i))) << "allgather " << i;
        ASSERT_TRUE(torch::equal(in, block(rank))) << "the allgather's input changed";
        at::Tensor all = fresh(torch::full({n * w}, -7.0, kD));
        pg.allgather_into_tensor(all, in)->wait();
        count();
        ASSERT_TRUE(torch::equal(all, torch::cat(outs))) << "allgather_into_tensor";
        std::vector<at::Tensor> gathered, scattered;
        if (rank == 0) {
          for (int i = 0; i < w; ++i) {
            gathered.push_back(fresh(untouched));
            scattered.push_back(fresh(block(i) * -1));
          }
        }
        pg.gather(gathered, in)->wait();
        count();
        for (size_t i = 0; i < gathered.size(); ++i) {
          ASSERT_TRUE(torch::equal(gathered[i], block(static_cast<int>(i)))) << "gather " << i;
        }
        at::Tensor one = fresh(untouched);
        pg.scatter(one, scattered)->wait();
        count();
        ASSERT_TRUE(torch::equal(one, block(rank) * -1)) << "scatter: " << test::describe(one);
        // Rank r's block i is mine + i; the reduce-scatter's block `rank` sums to sum + w * rank.
        std::vector<at::Tensor> blocks;
        for (int i = 0; i < w; ++i) blocks.push_back(fresh(mine + i));
        at::Tensor rs = fresh(untouched);
        pg.reduce_scatter(rs, blocks)->wait();
        count();
        ASSERT_TRUE(test::same(rs, sum + w * rank)) << "reduce_scatter: " << test::describe(rs);
        at::Tensor rst = fresh(untouched);
        pg.reduce_scatter_tensor(rst, fresh(torch::cat(blocks)))->wait();
        count();
        ASSERT_TRUE(test::same(rst, sum + w * rank)) << "reduce_scatter_tensor";
        std::vector<at::Tensor> ins, recvs, expect;
        std::vector<int64_t> in_splits, out_splits;
        for (int d = 0; d < w; ++d) {
          ins.push_back(fresh(alltoall_block(rank, d)));
          expect.push_back(alltoall_block(d, rank));
          recvs.push_back(fresh(torch::full({alltoall_rows(d, rank)}, -7, torch::kLong)));
          in_splits.push_back(alltoall_rows(rank, d));
          out_splits.push_back(alltoall_rows(d, rank));
        }
        pg.alltoall(recvs, ins)->wait();
        count();
        for (int s = 0; s < w; ++s)
          ASSERT_TRUE(torch::equal(recvs[s], expect[s])) << "alltoall " << s;
        at::Tensor got = fresh(torch::full({torch::cat(expect).numel()}, -7, torch::kLong));
        pg.alltoall_base(got, fresh(torch::cat(ins)), out_splits, in_splits)->wait();
        count();
        ASSERT_TRUE(torch::equal(got, torch::cat(expect))) << "alltoall_base";
      },
      /*strided=*/true);
  EXPECT_GE(staged, static_cast<size_t>(w * ops));
  // Two windows per rank at most (a root's of every rank's slice), as on contiguous tensors.
  EXPECT_LE(detail::staged_peak_bytes_for_tests(), 4 * size_t{8000} * static_cast<size_t>(w));
}

// Sends and receives around the ring (Note [Staged messages]): each message one DATA frame
// whose bytes are written as their pieces arrive and copied out as they land, window by window;
// receives posted before the send and after it, from a named rank and from any; strided
// tensors through stand-ins; staged ranks, an unstaged one and, with the default window, whole
// messages in one window.
TEST_P(OverlappedStaging, SendAndReceiveOfStagedTensors) {
  const int w = world();
  const int64_t n = 10001;  // doubles: 80008 bytes (more than an eager message), 11 windows
  for (const char* window : {"67108864", "8000"}) {
    for (auto [unstaged, strided] : {std::pair{-1, false}, {0, false}, {-1, true}}) {
      SCOPED_TRACE(str("window ", window, " unstaged rank ", unstaged, strided ? " strided" : ""));
      const size_t staged = on_staged_ranks(
          w, transport(), window, unstaged, {},
          [&](int rank, ProcessGroup& pg, const Fresh& fresh) {
            const int to = (rank + 1) % w, from = (rank + w - 1) % w;
            auto values = [&](int of, int k) {
              return torch::arange(n, torch::kDouble) * (of + 1) + k;
            };
            const auto untouched = torch::full({n}, -7.0, torch::kDouble);
            // Posted first: the message finds its receive waiting.
            at::Tensor early = fresh(untouched);
            auto r0 = pg.recv(early, from, /*tag=*/1);
            // Sent first (the receive comes 2 ms later): the message waits as unexpected.
            auto s0 = pg.send(fresh(values(rank, 1)), to, 1);
            auto s1 = pg.send(fresh(values(rank, 2)), to, 2);
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
            at::Tensor late = fresh(untouched);
            auto r1 = pg.recv_any_source(late, 2);
            for (const auto& work : {s0, s1, r0, r1}) work->wait();
            EXPECT_EQ(r1->source_rank(), from);
            ASSERT_TRUE(torch::equal(early, values(from, 1))) << "recv: " << test::describe(early);
            ASSERT_TRUE(torch::equal(late, values(from, 2)))
                << "recv_any_source: " << test::describe(late);
          },
          strided);
      const size_t bytes = n * 8, win = std::stoul(window);
      // A send holds the window it writes and the next one, a receive the one landing and the one
      // before it; a rank has four messages in flight at once.
      EXPECT_LE(detail::staged_peak_bytes_for_tests(),
                4 * 2 * std::min(win, bytes) * static_cast<size_t>(w));
      // Per staged rank: two messages sent and two received, each window staged once.
      const size_t windows = (bytes + win - 1) / win;
      const size_t staged_ranks = static_cast<size_t>(w - (unstaged >= 0 ? 1 : 0));
      EXPECT_EQ(staged, staged_ranks * 4 * windows);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsAndTransports, OverlappedStaging,
                         ::testing::Combine(::testing::Values(2, 3, 4),
                                            ::testing::Values("auto", "tcp")),
                         [](const auto& info) {
                           return "world" + std::to_string(std::get<0>(info.param)) + "_" +
                                  std::string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace tdist::comm
