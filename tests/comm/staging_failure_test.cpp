// Overlapped staging that cannot complete (Note [Overlapped staging], Note [Staged messages]):
// copies that never arrive, peers that never call or disagree, the knob's bad values. Each fails
// within its timeout with an error that says why, and leaves the caller's tensors as they were.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <thread>
#include <torch/torch.h>

#include "tdist/comm/ring/staging.h"
#include "tests/comm/comm_test_util.h"
#include "tests/comm/cpu_staging.h"

namespace tdist::comm {
namespace {

// A copy that does not arrive within the timeout fails the operation on every rank, naming it;
// the ranks do not hang.
TEST(OverlappedStagingFailure, ACopyThatNeverArrivesTimesOutSayingSo) {
  CpuStaging on(1000, 1500000);  // 1.5 s per piece
  tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_ALLREDUCE_ALGO", "ring"}});
  tdist::test::spawn(2, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 2, test::test_options(Millis(300)));
    auto x = torch::ones({500});  // two pieces
    try {
      pg->allreduce(x)->wait();
      ADD_FAILURE() << "rank " << rank << ": the allreduce finished before its copy arrived";
    } catch (const TimeoutError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("the copy of this rank's buffer to host memory (piece 0)"),
                std::string::npos)
          << msg;
    }
  });
}

// A windowed staged collective whose peer never calls fails within the timeout (a timeout, or the
// lost connection once the peer's group is gone) and frees every window it staged: the one that
// was moving and the next one already copying in.
// Ranks whose alltoall splits disagree: the rank that expects more bytes than its peer sends
// fails naming both sizes before any block moves, staged or not; no rank hangs.
TEST(OverlappedStagingFailure, AlltoallSplitsThatDisagreeFailNamingBothSizes) {
  for (bool staged : {false, true}) {
    SCOPED_TRACE(staged ? "staged" : "unstaged");
    std::optional<CpuStaging> on;
    if (staged) on.emplace(4000, 200);
    tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_WINDOW_BYTES", "8000"}});
    tdist::test::spawn(2, [&](int rank, std::shared_ptr<Store> store) {
      auto pg = create_process_group(store, rank, 2, test::test_options(Millis(5000)));
      // Rank 1 sends 2000 elements to rank 0, which expects 3000.
      const std::vector<int64_t> in_splits{2000, 2000};
      const std::vector<int64_t> out_splits =
          rank == 0 ? std::vector<int64_t>{2000, 3000} : std::vector<int64_t>{2000, 2000};
      at::Tensor out = torch::empty({out_splits[0] + out_splits[1]});
      try {
        pg->alltoall_base(out, torch::ones({4000}), out_splits, in_splits)->wait();
        EXPECT_EQ(rank, 1) << "rank 0 finished an alltoall its peer sent too little for";
      } catch (const InvalidArgument& e) {
        EXPECT_EQ(rank, 0) << e.what();
        EXPECT_THAT(e.what(), ::testing::HasSubstr("rank 1 sends 8000 bytes but this rank "
                                                   "expects 12000 bytes from it"));
      } catch (const std::exception& e) {
        EXPECT_EQ(rank, 1) << e.what();  // its group was aborted by rank 0's failure
      }
      // Rank 1's group lives until rank 0 has its error: a closed connection must not beat it.
      store->set(str("checked/", rank), "1");
      store->wait({"checked/0", "checked/1"});
    });
  }
}

TEST(OverlappedStagingFailure, AWindowedCollectiveWhosePeerNeverCallsFailsAndFreesItsWindows) {
  tdist::test::EnvGuard env(
      tdist::test::EnvVars{{"TDIST_ALLREDUCE_ALGO", "ring"}, {"TDIST_WINDOW_BYTES", "8000"}});
  CpuStaging on(1000, 20);
  const int64_t n = 20000;  // doubles: 20 windows and more
  using Op = std::function<void(ProcessGroup&)>;
  const std::vector<std::pair<const char*, Op>> ops{
      {"allreduce",
       [&](ProcessGroup& pg) { pg.allreduce(torch::ones({n}, torch::kDouble))->wait(); }},
      {"allgather_into_tensor",
       [&](ProcessGroup& pg) {
         pg.allgather_into_tensor(torch::empty({2 * n}, torch::kDouble),
                                  torch::ones({n}, torch::kDouble))
             ->wait();
       }},
      {"reduce_scatter_tensor",
       [&](ProcessGroup& pg) {
         pg.reduce_scatter_tensor(torch::empty({n}, torch::kDouble),
                                  torch::ones({2 * n}, torch::kDouble))
             ->wait();
       }},
      {"broadcast",  // from the absent rank (a root's sends may all fit in the transport)
       [&](ProcessGroup& pg) {
         BroadcastOptions o;
         o.root = 1;
         pg.broadcast(torch::ones({n}, torch::kDouble), o)->wait();
       }},
      {"reduce", [&](ProcessGroup& pg) { pg.reduce(torch::ones({n}, torch::kDouble))->wait(); }}};
  for (const auto& [name, op] : ops) {
    SCOPED_TRACE(name);
    const size_t before = detail::staged_buffers_for_tests();
    tdist::test::spawn(2, [&](int rank, std::shared_ptr<Store> store) {
      auto pg = create_process_group(store, rank, 2, test::test_options(Millis(300)));
      if (rank == 1) return;
      const auto start = std::chrono::steady_clock::now();
      EXPECT_THROW(op(*pg), tdist::Error) << name;
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
    });
    EXPECT_GE(detail::staged_buffers_for_tests() - before, 1u);  // it was staged
    detail::reset_staged_peak_for_tests();
    EXPECT_EQ(detail::staged_peak_bytes_for_tests(), 0u) << "staged host memory still held";
  }
}

// A strided tensor's operation (through a stand-in, Note [Strided device tensors]) whose peer
// never calls fails within the timeout with the operation's own error (its name and sequence
// number), and the caller's tensor keeps its values: a failed operation copies nothing back.
TEST(OverlappedStagingFailure, AStridedOperationWhosePeerNeverCallsFailsAndLeavesTheTensor) {
  tdist::test::EnvGuard env(
      tdist::test::EnvVars{{"TDIST_ALLREDUCE_ALGO", "ring"}, {"TDIST_WINDOW_BYTES", "8000"}});
  CpuStaging on(1000, 20, /*strided=*/true);
  tdist::test::spawn(2, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 2, test::test_options(Millis(300)));
    if (rank == 1) return;
    const auto values = torch::arange(20000, torch::kDouble);
    at::Tensor x = torch::empty({20000, 2}, torch::kDouble).select(1, 0).copy_(values);
    const size_t before = detail::staged_buffers_for_tests();
    const auto start = std::chrono::steady_clock::now();
    auto work = pg->allreduce(x);
    EXPECT_EQ(work->op(), "allreduce");
    try {
      work->wait();
      ADD_FAILURE() << "the allreduce succeeded without its peer";
    } catch (const tdist::Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr("allreduce (seq 0)"));
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
    EXPECT_TRUE(work->is_completed());
    EXPECT_FALSE(work->is_success());
    EXPECT_GE(detail::staged_buffers_for_tests() - before, 1u);  // it was staged
    EXPECT_TRUE(torch::equal(x, values)) << test::describe(x);
  });
}

// A staged message whose receive holds a different size fails that receive naming both sizes
// (the sender succeeds); a staged send nobody receives times out on its own; a staged send whose
// copy to host memory never arrives fails saying so (the frame is midway: the group aborts).
TEST(OverlappedStagingFailure, StagedMessagesThatCannotCompleteFailSayingWhy) {
  tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_WINDOW_BYTES", "8000"}});
  {
    CpuStaging on(4000, 20);
    tdist::test::spawn(2, [&](int rank, std::shared_ptr<Store> store) {
      auto pg = create_process_group(store, rank, 2, test::test_options());
      if (rank == 0) {
        pg->send(torch::ones({10001}, torch::kDouble), 1)->wait();
        try {
          SendRecvOptions brief;
          brief.timeout = Millis(300);
          pg->send(torch::ones({10001}, torch::kDouble), 1, /*tag=*/5, brief)->wait();
          ADD_FAILURE() << "a send that nobody receives succeeded";
        } catch (const TimeoutError& e) {
          EXPECT_THAT(e.what(), ::testing::HasSubstr("no matching receive was posted"));
        }
      } else {
        at::Tensor x = torch::full({12001}, -7.0, torch::kDouble);
        try {
          pg->recv(x, 0)->wait();
          ADD_FAILURE() << "a receive of the wrong size succeeded";
        } catch (const InvalidArgument& e) {
          EXPECT_THAT(e.what(), ::testing::HasSubstr("sent 80008 bytes but the receive buffer "
                                                     "holds 96008 bytes"));
        }
        EXPECT_TRUE(torch::equal(x, torch::full({12001}, -7.0, torch::kDouble)));
      }
      pg->barrier()->wait();
    });
  }
  CpuStaging on(4000, 1000000);  // 1 s per piece
  tdist::test::spawn(2, [&](int rank, std::shared_ptr<Store> store) {
    // Long enough for the receiver's clear-to-send to come back (the header leaves), short of
    // the first piece's arrival.
    auto pg = create_process_group(store, rank, 2, test::test_options(Millis(600)));
    const auto start = std::chrono::steady_clock::now();
    try {
      if (rank == 0) {
        pg->send(torch::ones({10001}, torch::kDouble), 1)->wait();
      } else {
        // Longer than the send's, so that the sender's deadline passes first: the receiver then
        // fails as its peer aborts.
        SendRecvOptions longer;
        longer.timeout = Millis(3000);
        at::Tensor x = torch::empty({10001}, torch::kDouble);
        pg->recv(x, 0, 0, longer)->wait();
      }
      ADD_FAILURE() << "rank " << rank << ": the message moved before its copy arrived";
    } catch (const Error& e) {
      if (rank == 0) {
        EXPECT_THAT(e.what(), ::testing::HasSubstr("the copy of its tensor to host memory did "
                                                   "not arrive"));
      }
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  });
}

// TDIST_STAGING_PIECE_BYTES, read when a group is created: 0 stages nothing in pieces (the same
// results), a piece size stages what holds two pieces; a bad value of it or of
// TDIST_WINDOW_BYTES fails the group's creation naming the variable.
TEST(OverlappedStagingKnob, ZeroTurnsItOffAndABadValueIsRefused) {
  tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_ALLREDUCE_ALGO", "ring"}});
  for (size_t piece : {size_t{0}, size_t{1000}}) {
    CpuStaging on(piece, 0);
    const size_t before = detail::staged_buffers_for_tests();
    tdist::test::spawn(2, [&](int rank, std::shared_ptr<Store> store) {
      auto pg = create_process_group(store, rank, 2, test::test_options());
      auto x = test::make_input(c10::ScalarType::Float, ReduceOp::SUM, 5000, rank);
      pg->allreduce(x)->wait();
      EXPECT_TRUE(test::same(x, test::expected(c10::ScalarType::Float, ReduceOp::SUM, 5000, 2)));
    });
    const size_t staged = detail::staged_buffers_for_tests() - before;
    EXPECT_EQ(staged, piece == 0 ? 0u : 2u) << "piece " << piece;
  }
  const std::vector<std::pair<std::string, std::string>> bad{
      {"TDIST_STAGING_PIECE_BYTES", "-1"},
      {"TDIST_STAGING_PIECE_BYTES", "1M"},
      {"TDIST_STAGING_PIECE_BYTES", "2000000000"},
      {"TDIST_WINDOW_BYTES", "0"},
      {"TDIST_WINDOW_BYTES", "64M"}};
  for (const auto& [name, value] : bad) {
    tdist::test::EnvGuard knob(tdist::test::EnvVars{{name, value}});
    auto store = std::make_shared<HashStore>();
    try {
      create_process_group(store, 0, 1, test::test_options());
      ADD_FAILURE() << name << "=" << value << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(name + "='" + value), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace tdist::comm
