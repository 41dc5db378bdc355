// Timeouts, aborts, destruction with pending work, the fingerprint check and bad arguments.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <thread>

#include "tdist/comm/ring/ring_process_group.h"
#include "tdist/core/env.h"
#include "tdist/core/net/address.h"
#include "tdist/core/tcp_store.h"
#include "tdist/core/logging.h"
#include "tests/comm/comm_test_util.h"
#include "tests/harness/expect.h"
#include "tests/harness/handshake_attacks.h"
#include "tests/harness/process.h"

namespace tdist::comm {
namespace {

std::string message_of(const std::shared_ptr<Work>& w) {
  try {
    w->wait(Millis(30000));
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

using tdist::test::contains;

TEST(Failure, TimeoutNamesRankOpPeerAndSequenceThenAborts) {
  tdist::test::spawn(2, [](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 2, test::test_options());
    pg->barrier()->wait();
    if (rank == 0) {
      AllreduceOptions o;
      o.timeout = Millis(300);
      auto w = pg->allreduce(torch::ones({1000}), o);  // rank 1 never joins
      std::string msg = message_of(w);
      EXPECT_TRUE(w->is_completed());
      EXPECT_FALSE(w->is_success());
      EXPECT_TRUE(contains(msg, "rank 0: allreduce (seq 1): Timed out")) << msg;
      EXPECT_TRUE(contains(msg, "waiting for rank 1")) << msg;
      EXPECT_THROW(std::rethrow_exception(w->exception()), TimeoutError);
      // Aborted: later operations fail at once, naming the cause.
      auto later = pg->barrier();
      EXPECT_TRUE(later->is_completed());
      EXPECT_TRUE(contains(message_of(later),
                           "rank 0: barrier (seq 2) failed: the process group "
                           "was aborted after: rank 0: allreduce (seq 1)"))
          << message_of(later);
    } else {
      // Rank 1 waits on rank 0 over the point-to-point channel instead; rank 0's abort closes
      // its connections, so this fails long before its own 60 s deadline.
      auto start = std::chrono::steady_clock::now();
      std::string msg = message_of(pg->recv(torch::empty({1}), 0));
      EXPECT_TRUE(contains(msg, "rank 1: recv from rank 0")) << msg;
      EXPECT_TRUE(contains(msg, "closed")) << msg;
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
    }
  });
}

TEST(Failure, AbortFailsPendingWorkOnEveryRankAndDestroyDoesNotHang) {
  tdist::test::spawn(3, [](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 3, test::test_options());
    pg->barrier()->wait();
    if (rank == 2) {
      std::this_thread::sleep_for(Millis(100));
      pg->abort();
      EXPECT_TRUE(contains(message_of(pg->barrier()), "aborted"));
    } else {
      // Ranks 0 and 1 wait for rank 2, which aborts instead of joining.
      auto w = pg->allreduce(torch::ones({100}));
      auto queued = pg->broadcast(torch::ones({3}));
      std::string msg = message_of(w);
      EXPECT_TRUE(contains(msg, str("rank ", rank, ": allreduce (seq 1)"))) << msg;
      EXPECT_FALSE(message_of(queued).empty());
    }
    pg.reset();  // must not hang
  });
}

// Spinning (Note [Spin, then sleep]) never outlasts an operation's deadline or an abort: with a
// one-second spin that busy-polls throughout, a 200 ms timeout and an abort 200 ms into an
// operation both fail it well before the spin would have ended.
TEST(Failure, ABusyPollingSpinEndsAtTheDeadlineAndOnAbort) {
  tdist::test::EnvGuard env(
      tdist::test::EnvVars{{"TDIST_SPIN_US", std::string("1000000")},
                           {"TDIST_BUSY_POLL_NS", std::string("1000000000")}});
  using Clock = std::chrono::steady_clock;
  for (bool abort : {false, true}) {
    tdist::test::spawn(2, [&](int rank, std::shared_ptr<Store> store) {
      auto pg = create_process_group(store, rank, 2, test::test_options());
      pg->barrier()->wait();
      if (rank == 0) {
        AllreduceOptions o;
        if (!abort) o.timeout = Millis(200);
        auto start = Clock::now();
        auto w = pg->allreduce(torch::ones({1000}), o);  // rank 1 never joins
        std::thread aborter;
        if (abort) {
          aborter = std::thread([&] {
            std::this_thread::sleep_for(Millis(200));
            pg->abort();
          });
        }
        std::string msg = message_of(w);
        if (aborter.joinable()) aborter.join();
        EXPECT_TRUE(contains(msg, abort ? "aborted" : "Timed out")) << msg;
        auto ms = std::chrono::duration_cast<Millis>(Clock::now() - start).count();
        EXPECT_LT(ms, 900) << msg;
        store->set("checked", "1");
      }
      store->wait({"checked"});  // rank 1's group lives until then: its end would fail rank 0
    });
  }
}

TEST(Failure, DestroyingWithPendingWorkFailsItWithoutHanging) {
  tdist::test::spawn(2, [](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 2, test::test_options());
    pg->barrier()->wait();
    std::shared_ptr<Work> w;
    if (rank == 0) w = pg->allreduce(torch::ones({10}));  // rank 1 never joins
    auto start = std::chrono::steady_clock::now();
    pg.reset();
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
    if (w) {
      EXPECT_TRUE(contains(message_of(w), "rank 0")) << message_of(w);
    }
  });
}

// A stranger that connects to a rank's mesh listener and sends nothing holds up no one: hellos
// are read from every connection at once, so the group is up while the stranger still has time
// to say hello (it is dropped, unlogged, with the listener). Read one after the other, the
// stranger's hello was waited for first: the group came up only after the stranger had timed
// out, which the log shows.
TEST(Failure, AStrangerThatSaysNothingDoesNotHoldUpGroupCreation) {
  const LogLevel saved = log_level();
  set_log_level(LogLevel::kWarn);
  ::testing::internal::CaptureStderr();
  auto store = std::make_shared<HashStore>(Millis(30000));
  std::exception_ptr first_error;
  std::thread first([&] {
    try {
      auto pg = create_process_group(store, 0, 2, test::test_options(Millis(3000)));
      pg->barrier()->wait();
    } catch (...) {
      first_error = std::current_exception();
    }
  });
  // The stranger connects as soon as rank 0 published its address, before rank 1 starts.
  const std::string addr = store->get_string("tdist/pg1/addr/0");
  const auto colon = addr.rfind(':');
  int stranger = net::connect_to(
      addr.substr(0, colon), static_cast<uint16_t>(std::stoi(addr.substr(colon + 1))),
      std::chrono::steady_clock::now() + std::chrono::seconds(5), "rank 0");
  std::this_thread::sleep_for(Millis(200));  // rank 0 accepts it before rank 1 connects
  auto pg = create_process_group(store, 1, 2, test::test_options(Millis(3000)));
  pg->barrier()->wait();
  first.join();
  ::close(stranger);
  const std::string log = ::testing::internal::GetCapturedStderr();
  set_log_level(saved);
  if (first_error) std::rethrow_exception(first_error);
  EXPECT_EQ(log.find("rejected a connection"), std::string::npos)
      << "the group waited for the stranger's hello:\n"
      << log;
}

// The mesh's port under hostile clients (the same attacks as the store's and RPC's ports,
// tests/harness/handshake_attacks.h): while rank 0 waits for rank 1, strangers without the
// token, with a wrong one, with a replayed hello, and one that stalls mid-handshake are
// refused; then the group comes up and works, and the stalled stranger is closed.
TEST(Failure, StrangersReplaysAndStallsAtTheMeshAreRefusedAndTheGroupComesUp) {
  const LogLevel saved = log_level();
  set_log_level(LogLevel::kOff);
  auto store = std::make_shared<HashStore>(Millis(30000));
  auto options = test::test_options(Millis(20000));
  options.token = "s3cret";
  std::exception_ptr first_error;
  std::thread first([&] {
    try {
      auto pg = create_process_group(store, 0, 2, options);
      pg->allreduce(torch::ones({4}))->wait();
    } catch (...) {
      first_error = std::current_exception();
    }
  });
  const std::string addr = store->get_string("tdist/pg1/addr/0");
  const auto colon = addr.rfind(':');
  tdist::test::HandshakePort port{addr.substr(0, colon),
                                  static_cast<uint16_t>(std::stoi(addr.substr(colon + 1))),
                                  net::Service::kMesh, 13};
  EXPECT_TRUE(tdist::test::refuses_token(port, ""));
  EXPECT_TRUE(tdist::test::refuses_token(port, "wrong"));
  EXPECT_TRUE(tdist::test::refuses_replayed_hello(port, "s3cret"));
  const int stalled = tdist::test::stalled_handshake(port, "s3cret");
  auto pg = create_process_group(store, 1, 2, options);
  auto t = torch::ones({4});
  pg->allreduce(t)->wait();
  first.join();
  if (first_error) std::rethrow_exception(first_error);
  EXPECT_TRUE(torch::equal(t, torch::full({4}, 2.0f)));
  EXPECT_TRUE(tdist::test::closed_within(stalled, Millis(5000)));
  ::close(stalled);
  set_log_level(saved);
}

// Ranks with different tokens do not form a group: the one refused says why at once, the
// other times out naming the rank that never connected.
TEST(Failure, RanksWithDifferentTokensFailGroupCreationWithAClearError) {
  const LogLevel saved = log_level();
  set_log_level(LogLevel::kOff);
  tdist::test::spawn(2, [](int rank, std::shared_ptr<Store> store) {
    auto options = test::test_options(Millis(3000));
    options.token = rank == 0 ? "one" : "another";
    if (rank == 0) {
      tdist::test::expect_contains(tdist::test::expect_throw<TimeoutError>(
                                       [&] { create_process_group(store, rank, 2, options); }),
                                   "rank(s) 1 did not connect");
    } else {
      tdist::test::expect_contains(
          tdist::test::expect_throw<ProtocolError>(
              [&] { create_process_group(store, rank, 2, options); }),
          "rank 1: handshake with rank 0: connection closed by the peer (rank 0 refused this "
          "connection: is the token the same on every process?)");
    }
  });
  set_log_level(saved);
}

TEST(Failure, FingerprintMismatchNamesRanksAndFields) {
  tdist::test::EnvGuard env(tdist::test::EnvVars{{"TDIST_DEBUG", std::string("DETAIL")}});
  tdist::test::spawn(3, [](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 3, test::test_options());
    pg->allreduce(torch::ones({4}))->wait();  // matching calls pass
    // Rank 2 passes a different shape.
    auto w = pg->allreduce(torch::ones({rank == 2 ? 5 : 4}));
    std::string msg = message_of(w);
    EXPECT_TRUE(contains(msg, "rank 2 differs from rank 0: shapes [[4]] vs [[5]]")) << msg;
    EXPECT_FALSE(contains(msg, "rank 1 differs")) << msg;
    EXPECT_THROW(std::rethrow_exception(w->exception()), InvalidArgument);
    // Rank 1 calls broadcast where the others call allreduce.
    auto x = torch::ones({4});
    auto w2 = rank == 1 ? pg->broadcast(x) : pg->allreduce(x);
    msg = message_of(w2);
    EXPECT_TRUE(contains(msg, "rank 1 differs from rank 0: op allreduce vs broadcast")) << msg;
    // The group is still usable.
    auto y = torch::ones({4});
    pg->allreduce(y)->wait();
    EXPECT_TRUE(torch::equal(y, torch::full({4}, 3.0)));
  });
}

// Single-copy operations (Note [Single-copy collectives]) announce their size with their
// address: ranks that disagree all fail before any memory is read or written, and the group
// stays usable. Without the check, the world-2 broadcast's root would write past the end of
// the smaller peer's tensor. Ranks that read each other's memory are processes (threads of one
// process never do), so this runs in child processes; exit 0 when all of it held.
TDIST_TEST_CHILD(comm_single_copy_sizes_child) {
  torch::set_num_threads(1);
  ::setenv("TDIST_SINGLE_COPY_BYTES", "1", 1);
  ::setenv("TDIST_TRANSPORT", "auto", 1);
  const auto port = static_cast<uint16_t>(env::require_int("TDIST_TEST_STORE_PORT", 1, 65535));
  auto store = std::make_shared<TCPStore>("127.0.0.1", port, false, Millis(60000));
  auto pg = create_process_group(store, rank, world_size, test::test_options());
  auto* ring = dynamic_cast<detail::RingProcessGroup*>(pg.get());
  if (ring == nullptr || ring->single_copy_bytes() != 1) {
    std::printf("rank %d: no single copy between these processes\n", rank);
    return 77;
  }
  const int64_t n = rank == 0 ? 12000 : 4000;  // the root's half would overrun the others'
  auto x = torch::full({n}, double(rank));
  auto guard = torch::full({8}, -1.0);  // allocated after x: a write past x may land here
  auto w = world_size == 2 ? pg->broadcast(x)
                           : pg->allgather_into_tensor(torch::empty({world_size * n}), x);
  const std::string msg = message_of(w);
  int bad = 0;
  if (!contains(msg, "bytes per rank, this rank with")) {
    std::printf("rank %d: unexpected error '%s'\n", rank, msg.c_str());
    ++bad;
  }
  bool invalid = false;
  try {
    std::rethrow_exception(w->exception());
  } catch (const InvalidArgument&) {
    invalid = true;
  } catch (...) {}
  if (!invalid) ++bad;
  if (!torch::equal(x, torch::full({n}, double(rank)))) ++bad;  // untouched
  if (!torch::equal(guard, torch::full({8}, -1.0))) ++bad;
  auto y = torch::ones({4});
  pg->allreduce(y)->wait();
  if (!torch::equal(y, torch::full({4}, double(world_size)))) ++bad;
  return bad;
}

TEST(Failure, SingleCopyRanksWithDifferentSizesFailAndKeepTheGroup) {
  for (int world : {2, 3}) {
    TCPStoreServer server("127.0.0.1", 0);
    tdist::test::Processes procs("comm_single_copy_sizes_child", world,
                                 {{"TDIST_TEST_STORE_PORT", std::to_string(server.port())}});
    auto results = procs.wait_all(Millis(90000));
    if (results[0].exited && results[0].exit_code == 77) {
      GTEST_SKIP() << "the kernel does not let these processes read each other: "
                   << results[0].output;
    }
    EXPECT_EQ(tdist::test::Processes::failures(results), "") << "world " << world;
  }
}

// A world-2 single-copy broadcast whose root comes late (as a root that was stopped and then
// resumed): rank 1 announces its tensor's address, times out, and puts other values in the
// tensor (as a caller reusing the memory would); only then does rank 0 call the broadcast,
// with rank 1's address waiting for it. No byte of rank 1 may change: the root never writes
// into its peer (Note [Single-copy collectives]). Exit 0 when that held.
TDIST_TEST_CHILD(comm_single_copy_late_root_child) {
  torch::set_num_threads(1);
  ::setenv("TDIST_TRANSPORT", "auto", 1);
  const auto port = static_cast<uint16_t>(env::require_int("TDIST_TEST_STORE_PORT", 1, 65535));
  auto store = std::make_shared<TCPStore>("127.0.0.1", port, false, Millis(60000));
  auto pg = create_process_group(store, rank, world_size,
                                 test::test_options(Millis(rank == 0 ? 20000 : 1000)));
  auto* ring = dynamic_cast<detail::RingProcessGroup*>(pg.get());
  const int64_t n = 1 << 20;  // 4 MiB: above the single-copy threshold
  if (ring == nullptr || ring->single_copy_bytes() > n * 4) {
    std::printf("rank %d: no single copy between these processes\n", rank);
    return 77;
  }
  if (rank == 0) {
    store->wait({"late"}, Millis(60000));
    auto x = torch::ones({n});
    const std::string msg = message_of(pg->broadcast(x));
    std::printf("rank 0: %s\n", msg.empty() ? "the broadcast completed" : msg.c_str());
    store->set("root_done", "1");
    return 0;
  }
  auto x = torch::zeros({n});
  const std::string msg = message_of(pg->broadcast(x));
  if (!contains(msg, "Timed out")) {
    std::printf("rank 1: expected a timeout, got '%s'\n", msg.c_str());
    return 21;
  }
  x.fill_(7.0);
  store->set("late", "1");
  store->wait({"root_done"}, Millis(60000));
  std::this_thread::sleep_for(Millis(200));
  const int64_t changed = x.ne(7.0).sum().item<int64_t>();
  if (changed != 0) std::printf("rank 1: the late root changed %lld values\n", (long long)changed);
  return changed == 0 ? 0 : 22;
}

TEST(Failure, ALateSingleCopyRootNeverWritesIntoItsPeer) {
  TCPStoreServer server("127.0.0.1", 0);
  tdist::test::Processes procs("comm_single_copy_late_root_child", 2,
                               {{"TDIST_TEST_STORE_PORT", std::to_string(server.port())}});
  auto results = procs.wait_all(Millis(90000));
  if (results[1].exited && results[1].exit_code == 77) {
    GTEST_SKIP() << "the kernel does not let these processes read each other: "
                 << results[1].output;
  }
  EXPECT_EQ(tdist::test::Processes::failures(results), "") << results[0].output;
}

TEST(Failure, BadArgumentsThrowInvalidArgumentAndChangeNothing) {
  tdist::test::spawn(2, [](int rank, std::shared_ptr<Store> store) {
    auto pg = create_process_group(store, rank, 2, test::test_options());
    auto x = torch::ones({4});
    BroadcastOptions b;
    b.root = 2;
    EXPECT_THROW(pg->broadcast(x, b), InvalidArgument);
    ReduceOptions r;
    r.root = -1;
    EXPECT_THROW(pg->reduce(x, r), InvalidArgument);
    EXPECT_THROW(pg->allgather({torch::empty({4})}, x), InvalidArgument);  // one output, 2 ranks
    EXPECT_THROW(pg->allgather({torch::empty({4}), torch::empty({3})}, x), InvalidArgument);
    EXPECT_THROW(pg->allgather_into_tensor(torch::empty({7}), x), InvalidArgument);
    EXPECT_THROW(pg->reduce_scatter_tensor(torch::empty({2}), x.repeat(3)), InvalidArgument);
    EXPECT_THROW(pg->alltoall_base(torch::empty({3}), torch::empty({3}), {}, {}), InvalidArgument);
    EXPECT_THROW(pg->alltoall_base(torch::empty({4}), torch::empty({4}), {1, 1}, {3, 2}),
                 InvalidArgument);
    EXPECT_THROW(pg->gather({torch::empty({4})}, x),
                 InvalidArgument);  // wrong count on root/non-root
    AllreduceOptions avg;
    avg.op = ReduceOp::AVG;
    EXPECT_THROW(pg->allreduce(torch::ones({4}, torch::kInt), avg), InvalidArgument);
    AllreduceOptions band;
    band.op = ReduceOp::BAND;
    EXPECT_THROW(pg->allreduce(torch::ones({4}), band), InvalidArgument);
    EXPECT_THROW(pg->allreduce(at::Tensor()), InvalidArgument);
    EXPECT_THROW(pg->allreduce_coalesced({torch::ones({1}), torch::ones({1}, torch::kInt)}),
                 InvalidArgument);
    EXPECT_TRUE(torch::equal(x, torch::ones({4})));
    // No sequence number was consumed and the group works.
    auto w = pg->allreduce(x);
    w->wait();
    EXPECT_EQ(w->sequence_number(), 0u);
    EXPECT_TRUE(torch::equal(x, torch::full({4}, 2.0)));
  });
}

TEST(Failure, BackendNamesAndCreationArguments) {
  auto store = std::make_shared<HashStore>();
  ProcessGroup::Options o;
  o.backend = "gloo";
  EXPECT_THROW(create_process_group(store, 0, 1, o), InvalidArgument);
  o.backend = "cpu:ring,cuda:gloo";  // no such CUDA backend (cuda:nccl: tests/comm/cuda_test.cpp)
  EXPECT_THROW(create_process_group(store, 0, 1, o), InvalidArgument);
  o.backend = "cpu:ring";
  auto pg = create_process_group(store, 0, 1, o);
  EXPECT_EQ(pg->backend_name(), "ring");
  EXPECT_THROW(create_process_group(store, 1, 1, {}), InvalidArgument);
  EXPECT_THROW(create_process_group(std::shared_ptr<Store>(), 0, 1, {}), InvalidArgument);
}

TEST(Failure, CreationTimesOutNamingMissingRanks) {
  auto store = std::make_shared<HashStore>();
  auto opts = test::test_options(Millis(300));
  try {
    create_process_group(store, 2, 3, opts);  // ranks 0 and 1 never come
    ADD_FAILURE() << "no timeout";
  } catch (const TimeoutError& e) {
    EXPECT_TRUE(contains(e.what(), "rank(s) 0, 1 did not publish their address")) << e.what();
  }
}

}  // namespace
}  // namespace tdist::comm
