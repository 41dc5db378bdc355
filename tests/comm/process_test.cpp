// Real processes: the collectives across 2 and 4 processes (TCPStore; one case through the
// env:// init_method), and a process killed in the middle of an allreduce loop.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

#include "tdist/comm/ring/ring_process_group.h"
#include "tdist/core/env.h"
#include "tdist/core/tcp_store.h"
#include "tests/comm/comm_test_util.h"
#include "tests/harness/process.h"
#include "tests/harness/net.h"

namespace tdist::comm {
namespace {

using ::tdist::test::free_port;

std::shared_ptr<Store> child_store() {
  auto port = static_cast<uint16_t>(env::require_int("TDIST_TEST_STORE_PORT", 1, 65535));
  return std::make_shared<TCPStore>("127.0.0.1", port, false, Millis(60000));
}

// Returns the number of mismatches (printed).
int run_collectives(ProcessGroup& pg) {
  const int rank = pg.rank();
  const int world = pg.size();
  int bad = 0;
  auto expect = [&](bool ok, const char* what) {
    if (!ok) {
      std::cerr << "rank " << rank << ": wrong result of " << what << std::endl;
      ++bad;
    }
  };
  for (int64_t n : {1, 1000, 300000}) {
    auto x = torch::full({n}, double(rank + 1));
    pg.allreduce(x)->wait();
    expect(torch::equal(x, torch::full({n}, world * (world + 1) / 2.0)), "allreduce");
  }
  auto b = rank == 1 ? torch::arange(5000, torch::kLong) : torch::zeros({5000}, torch::kLong);
  BroadcastOptions bo;
  bo.root = 1;
  pg.broadcast(b, bo)->wait();
  expect(torch::equal(b, torch::arange(5000, torch::kLong)), "broadcast");
  auto in = torch::full({3}, double(rank));
  auto flat = torch::empty({3 * world});
  pg.allgather_into_tensor(flat, in)->wait();
  for (int r = 0; r < world; ++r)
    expect(torch::equal(flat.narrow(0, 3 * r, 3), torch::full({3}, double(r))), "allgather");
  auto rs_in = torch::arange(world * 4, torch::kFloat);
  auto rs_out = torch::empty({4});
  pg.reduce_scatter_tensor(rs_out, rs_in)->wait();
  expect(torch::equal(rs_out, torch::arange(rank * 4, rank * 4 + 4, torch::kFloat) * world),
         "reduce_scatter");
  auto a_in = torch::full({world}, double(rank));
  auto a_out = torch::empty({world});
  pg.alltoall_base(a_out, a_in, {}, {})->wait();
  expect(torch::equal(a_out, torch::arange(world, torch::kFloat)), "alltoall");
  pg.barrier()->wait();
  if (rank == 0) {
    for (int r = 1; r < world; ++r) pg.send(torch::full({2}, double(r)), r, 3)->wait();
  } else {
    auto t = torch::empty({2});
    pg.recv(t, 0, 3)->wait();
    expect(torch::equal(t, torch::full({2}, double(rank))), "send/recv");
  }
  pg.barrier()->wait();
  return bad;
}

TDIST_TEST_CHILD(comm_collectives_child) {
  torch::set_num_threads(1);
  auto pg = create_process_group(child_store(), rank, world_size, test::test_options());
  return run_collectives(*pg);
}

TDIST_TEST_CHILD(comm_env_init_child) {
  torch::set_num_threads(1);
  auto pg = create_process_group("env://", -1, -1, test::test_options());
  return pg->rank() == rank && pg->size() == world_size ? run_collectives(*pg) : 20;
}

// Allreduces of 1 MiB in a loop until one fails; exits 0 when the failure names this rank, the
// operation, its sequence number and a peer.
// The single-copy allreduce (Note [Single-copy allreduce] in comm/algorithms/single_copy.h),
// asked for by name in a group of its own: right below the world size (segments of nothing),
// at an odd size and over several windows, for SUM, AVG and MAX; three rounds and no forwarded
// hop per operation at every world (a ring would forward 2(n-1) - 1); and ranks that pass
// different sizes all fail with the sizes named, before any memory is read, and the group
// stays usable. Returns the number of mismatches (printed).
int check_single_copy_allreduce(int rank, int world) {
  ProcessGroup::Options o = test::test_options();
  o.ring.allreduce_algo = "single_copy";
  auto pg = create_process_group(child_store(), rank, world, o);
  auto* ring = dynamic_cast<detail::RingProcessGroup*>(pg.get());
  if (ring == nullptr) return 1;
  int bad = 0;
  for (int64_t n : {int64_t{1}, int64_t{1001}, int64_t{300001}}) {
    for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX}) {
      auto x = torch::arange(n, torch::kDouble) + rank;
      AllreduceOptions ao;
      ao.op = op;
      pg->allreduce(x, ao)->wait();
      const auto base = torch::arange(n, torch::kDouble);
      const at::Tensor want = op == ReduceOp::SUM   ? base * world + world * (world - 1) / 2.0
                              : op == ReduceOp::AVG ? base + (world - 1) / 2.0
                                                    : base + (world - 1);
      if (!torch::allclose(x, want)) {
        std::cerr << "rank " << rank << ": wrong single-copy allreduce of " << n << " (op "
                  << int(op) << ")" << std::endl;
        ++bad;
      }
      const auto c = ring->last_counts();
      const auto peers = static_cast<uint64_t>(world - 1);
      if (static_cast<size_t>(n) * 8 <= ring->window_bytes() &&
          (c.runs != 3 || c.forwards != 0 || c.sends != 3 * peers)) {
        std::cerr << "rank " << rank << ": single-copy allreduce of " << n << ": runs " << c.runs
                  << ", forwards " << c.forwards << ", sends " << c.sends << "; expected 3, 0, "
                  << 3 * peers << std::endl;
        ++bad;
      }
    }
  }
  auto odd = torch::ones({rank == 0 ? 100 : 101}, torch::kDouble);
  try {
    pg->allreduce(odd)->wait();
    std::cerr << "rank " << rank << ": allreduces of 100 and 101 elements did not fail"
              << std::endl;
    ++bad;
  } catch (const std::exception& e) {
    if (std::string(e.what()).find("bytes per rank") == std::string::npos) {
      std::cerr << "rank " << rank << ": unexpected error: " << e.what() << std::endl;
      ++bad;
    }
  }
  auto after = torch::ones({5}, torch::kDouble);
  pg->allreduce(after)->wait();
  if (!torch::equal(after, torch::full({5}, double(world), torch::kDouble))) {
    std::cerr << "rank " << rank << ": wrong allreduce after the mismatch" << std::endl;
    ++bad;
  }
  return bad;
}

// Processes that read each other's memory (Note [Single-copy collectives]). TDIST_TEST_SC_MODE:
// "all": every rank asks for single copy from one byte; "max": rank 1 asks from 4096 bytes and
// the group must take the largest, and the same for the window (rank 1 40000 bytes, the others
// 20000: the large allreduces, allgathers and reduce-scatters below run in windows, which
// desynchronise unless all agree; an allgather window's blocks are still single copies);
// "off": the last rank disables it, so no rank may use it; "ring": every rank asks for single
// copy from one byte and the allgather by single copy (TDIST_ALLGATHER_ALGO) but rank 0 for the
// ring, so no allgather may read a peer; "single_copy": every rank asks for both, so even a
// world-2 allgather of one byte reads its peer. Whatever the mode, the ranks must agree on where
// the allgather reads its peers (Note [Which allgather]: under auto the group measures).
// Allgathers (in place and not) and broadcasts of several sizes from every root must be right
// either way, and so must every other collective; where single copy is on, the single-copy
// allreduce too (check_single_copy_allreduce).
TDIST_TEST_CHILD(comm_single_copy_child) {
  torch::set_num_threads(1);
  const std::string mode = env::get("TDIST_TEST_SC_MODE").value_or("all");
  ::setenv("TDIST_SINGLE_COPY_BYTES", mode == "max" && rank == 1 ? "4096" : "1", 1);
  if (mode == "max") ::setenv("TDIST_WINDOW_BYTES", rank == 1 ? "40000" : "20000", 1);
  if (mode == "off" && rank == world_size - 1) ::setenv("TDIST_SINGLE_COPY", "0", 1);
  if (mode == "ring" || mode == "single_copy") {
    ::setenv("TDIST_ALLGATHER_ALGO", mode == "ring" && rank == 0 ? "ring" : "single_copy", 1);
  }
  auto pg = create_process_group(child_store(), rank, world_size, test::test_options());
  auto* ring = dynamic_cast<detail::RingProcessGroup*>(pg.get());
  if (ring == nullptr) return 30;
  constexpr uint64_t kNo = detail::RingProcessGroup::kNoSingleCopy;
  const uint64_t want = mode == "max" ? 4096 : mode == "off" ? kNo : 1;
  if (ring->single_copy_bytes() != want) {
    std::cerr << "rank " << rank << ": single-copy threshold " << ring->single_copy_bytes()
              << ", expected " << want << std::endl;
    return 31;
  }
  // Under auto a world-2 group reads its peer only when that measured faster; from world 3 it
  // reads from the threshold either way.
  const uint64_t allgather = ring->allgather_single_copy_bytes();
  const bool measured = mode == "all" && world_size == 2 && allgather == kNo;
  const uint64_t want_allgather = mode == "ring" || mode == "off" ? kNo : measured ? kNo : want;
  auto every = torch::empty({world_size}, torch::kLong);
  pg->allgather_into_tensor(every, torch::full({1}, static_cast<int64_t>(allgather)))->wait();
  if (allgather != want_allgather ||
      !torch::equal(every, torch::full({world_size}, static_cast<int64_t>(allgather)))) {
    std::cerr << "rank " << rank << ": the ranks' allgather single-copy thresholds are " << every
              << ", expected " << want_allgather << " on every rank" << std::endl;
    return 33;
  }
  const size_t want_window = mode == "max" ? 40000 : size_t{64} << 20;
  if (ring->window_bytes() != want_window) {
    std::cerr << "rank " << rank << ": window " << ring->window_bytes() << ", expected "
              << want_window << std::endl;
    return 32;
  }
  int bad = 0;
  for (int64_t n : {1, 1000, 300000}) {
    auto in = torch::arange(n, torch::kDouble) + rank * 1e6;
    auto flat = torch::empty({n * world_size}, torch::kDouble);
    pg->allgather_into_tensor(flat, in)->wait();
    auto in_place = torch::zeros({n * world_size}, torch::kDouble);
    in_place.narrow(0, rank * n, n).copy_(in);
    pg->allgather_into_tensor(in_place, in_place.narrow(0, rank * n, n))->wait();
    for (int r = 0; r < world_size; ++r) {
      auto block = torch::arange(n, torch::kDouble) + r * 1e6;
      if (!torch::equal(flat.narrow(0, r * n, n), block) ||
          !torch::equal(in_place.narrow(0, r * n, n), block)) {
        std::cerr << "rank " << rank << ": wrong allgather block " << r << " of " << n << std::endl;
        ++bad;
      }
    }
    auto rs_out = torch::empty({n}, torch::kDouble);
    pg->reduce_scatter_tensor(rs_out, torch::arange(n * world_size, torch::kDouble) + rank)->wait();
    const auto rs_want = torch::arange(rank * n, (rank + 1) * n, torch::kDouble) * world_size +
                         world_size * (world_size - 1) / 2.0;
    if (!torch::equal(rs_out, rs_want)) {
      std::cerr << "rank " << rank << ": wrong reduce-scatter of " << n << std::endl;
      ++bad;
    }
    for (int root = 0; root < world_size; ++root) {
      auto x = rank == root ? torch::arange(n, torch::kLong) * (root + 1)
                            : torch::zeros({n}, torch::kLong);
      BroadcastOptions o;
      o.root = root;
      pg->broadcast(x, o)->wait();
      if (!torch::equal(x, torch::arange(n, torch::kLong) * (root + 1))) {
        std::cerr << "rank " << rank << ": wrong broadcast of " << n << " from " << root
                  << std::endl;
        ++bad;
      }
    }
  }
  if (mode != "off") bad += check_single_copy_allreduce(rank, world_size);
  return bad + run_collectives(*pg);
}

// One round of TDIST_TEST_OP on every rank (the fault matrix's operations below).
void run_op(ProcessGroup& pg, const std::string& op, const at::Tensor& x) {
  const int world = pg.size(), rank = pg.rank();
  if (op == "allreduce" || op == "symmetric_allreduce") {  // x is symmetric for the latter
    pg.allreduce(x)->wait();
  } else if (op == "broadcast" || op == "symmetric_broadcast") {
    pg.broadcast(x)->wait();
  } else if (op == "symmetric_allgather") {  // x: the symmetric output, gathered in place
    const int64_t block = x.numel() / world;
    pg.allgather_into_tensor(x, x.narrow(0, rank * block, block))->wait();
  } else if (op == "allgather") {
    pg.allgather_into_tensor(at::empty({x.numel() * world}), x)->wait();
  } else if (op == "reduce_scatter" || op == "symmetric_reduce_scatter") {  // x: the input
    pg.reduce_scatter_tensor(at::empty({x.numel() / world}), x)->wait();
  } else if (op == "alltoall") {
    pg.alltoall_base(at::empty_like(x), x, {}, {})->wait();
  } else if (op == "barrier") {
    pg.barrier()->wait();
  } else if (op == "send") {  // a ring of sends and receives
    auto out = pg.send(x, (rank + 1) % world);
    pg.recv(at::empty_like(x), (rank + world - 1) % world)->wait();
    out->wait();
  } else {
    TDIST_THROW(InvalidArgument, "unknown TDIST_TEST_OP ", op);
  }
}

// Repeats TDIST_TEST_OP until it fails (a peer was killed or stopped): the error must name this
// rank and the operation and say which peer was lost or waited for, and a later operation must
// fail too.
TDIST_TEST_CHILD(comm_killed_peer_child) {
  torch::set_num_threads(1);
  const std::string op = env::get("TDIST_TEST_OP").value_or("allreduce");
  const Millis timeout(env::get_int("TDIST_TEST_OP_TIMEOUT_MS", 20000, 1, 600000));
  auto store = child_store();
  auto pg = create_process_group(store, rank, world_size, test::test_options(timeout));
  // Note [Symmetric memory]: the peers read this buffer where it lies.
  auto x = op == "symmetric_allreduce" || op == "symmetric_broadcast"
               ? pg->symmetric_empty({3 << 16}, torch::kFloat).fill_(1)
           : op == "symmetric_allgather" || op == "symmetric_reduce_scatter"
               ? pg->symmetric_empty({(3 << 16) * world_size}, torch::kFloat).fill_(1)
               : torch::ones({3 << 16});
  for (int i = 0;; ++i) {
    try {
      run_op(*pg, op, x);
    } catch (const std::exception& e) {
      std::string msg = e.what();
      std::cerr << "rank " << rank << " failed at iteration " << i << ": " << msg << std::endl;
      // The names errors give the operations run_op calls.
      const std::map<std::string, std::string> names = {
          {"allgather", "allgather_into_tensor (seq "},
          {"symmetric_allreduce", "allreduce (seq "},
          {"symmetric_broadcast", "broadcast (seq "},
          {"symmetric_allgather", "allgather_into_tensor (seq "},
          {"reduce_scatter", "reduce_scatter_tensor (seq "},
          {"symmetric_reduce_scatter", "reduce_scatter_tensor (seq "},
          {"alltoall", "alltoall_base (seq "},
          {"send", ""}};
      const auto it = names.find(op);
      const std::string name = it != names.end() ? it->second : op + " (seq ";
      bool named = msg.find(str("rank ", rank, ": ", name)) != std::string::npos;
      bool peer = false;
      for (const char* why :
           {"lost rank", "waiting for rank", "Timed out", "closed its connection"}) {
        peer = peer || msg.find(why) != std::string::npos;
      }
      // Later operations fail too, promptly (at once after a collective's failure, which
      // aborts the group; after a point-to-point one, when they meet the lost peer).
      auto later = pg->barrier();
      try {
        later->wait(Millis(10000));
      } catch (const std::exception&) {}
      bool failed_later = later->is_completed() && !later->is_success();
      return named && peer && failed_later ? 0 : 11;
    }
    store->add(str("progress/", rank), 1);
  }
}

// Rendezvous with a rank that dies inside it: rank 1 creates the group at once and is struck
// once it has published its address (it then waits for rank 0's); ranks 0 and 2 start creating
// theirs after the strike ("go"), with a timeout of TDIST_TEST_OP_TIMEOUT_MS. Each must fail
// with an error of the group's creation that names rank 1.
TDIST_TEST_CHILD(comm_rendezvous_child) {
  torch::set_num_threads(1);
  const Millis timeout(env::get_int("TDIST_TEST_OP_TIMEOUT_MS", 3000, 1, 600000));
  auto store = child_store();
  if (rank == 1) {
    create_process_group(store, rank, world_size, test::test_options(Millis(120000)));
    return 3;  // struck before it ends
  }
  store->wait({"go"}, Millis(60000));
  try {
    create_process_group(store, rank, world_size, test::test_options(timeout));
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    std::cerr << "rank " << rank << ": " << msg << std::endl;
    const bool creating = msg.find("creating the process group") != std::string::npos;
    const bool names_1 =
        msg.find("rank 1") != std::string::npos || msg.find("rank(s) 1") != std::string::npos;
    return creating && names_1 ? 0 : 13;
  }
  return 12;
}

class ProcessTest : public ::testing::TestWithParam<int> {};

TEST_P(ProcessTest, CollectivesOverTCPStore) {
  TCPStoreServer server("127.0.0.1", 0);
  tdist::test::Processes procs("comm_collectives_child", GetParam(),
                               {{"TDIST_TEST_STORE_PORT", std::to_string(server.port())}});
  auto results = procs.wait_all(Millis(90000));
  EXPECT_EQ(tdist::test::Processes::failures(results), "");
}

class SingleCopyProcesses : public ::testing::TestWithParam<std::tuple<int, const char*>> {};

TEST_P(SingleCopyProcesses, ResultsAreRightAndTheRanksAgree) {
  TCPStoreServer server("127.0.0.1", 0);
  tdist::test::Processes procs("comm_single_copy_child", std::get<0>(GetParam()),
                               {{"TDIST_TEST_STORE_PORT", std::to_string(server.port())},
                                {"TDIST_TRANSPORT", "auto"},
                                {"TDIST_TEST_SC_MODE", std::get<1>(GetParam())}});
  auto results = procs.wait_all(Millis(90000));
  EXPECT_EQ(tdist::test::Processes::failures(results), "");
}

INSTANTIATE_TEST_SUITE_P(Modes, SingleCopyProcesses,
                         ::testing::Values(std::make_tuple(2, "all"), std::make_tuple(3, "all"),
                                           std::make_tuple(4, "all"), std::make_tuple(3, "max"),
                                           std::make_tuple(3, "off"), std::make_tuple(3, "ring"),
                                           std::make_tuple(2, "single_copy")),
                         [](const auto& info) {
                           return str("world", std::get<0>(info.param), "_",
                                      std::get<1>(info.param));
                         });

// env://: rank 0's process hosts the TCPStore on MASTER_PORT.
TEST(ProcessTest, EnvInitMethod) {
  tdist::test::Processes procs(
      "comm_env_init_child", 2,
      {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(free_port())}});
  auto results = procs.wait_all(Millis(90000));
  EXPECT_EQ(tdist::test::Processes::failures(results), "");
}

INSTANTIATE_TEST_SUITE_P(Worlds, ProcessTest, ::testing::Values(2, 4));

// The fault matrix: a rank dies (SIGKILL, SIGTERM, abort()) or stops (SIGSTOP) in the middle
// of each collective and of point-to-point traffic, over shared memory ("auto") and TCP. The
// survivors get an error naming themselves, the operation and the lost peer, within the bound:
// at once for a death (the connection breaks), within the operation's timeout for a stop.
struct Fault {
  std::string op;
  int sig;
  std::string transport;
};

std::ostream& operator<<(std::ostream& os, const Fault& f) {
  return os << f.op << "_" << strsignal(f.sig) << "_" << f.transport;
}

class ProcessFailure : public ::testing::TestWithParam<Fault> {};

TEST_P(ProcessFailure, SurvivorsGetAnErrorNamingTheLostPeerWithinTheBound) {
  const Fault f = GetParam();
  const int world = 3;
  const Millis op_timeout(f.sig == SIGSTOP ? 3000 : 20000);
  TCPStoreServer server("127.0.0.1", 0);
  TCPStore store("127.0.0.1", server.port(), false, Millis(60000));
  tdist::test::Processes procs("comm_killed_peer_child", world,
                               {{"TDIST_TEST_STORE_PORT", std::to_string(server.port())},
                                {"TDIST_TRANSPORT", f.transport},
                                {"TDIST_TEST_OP", f.op},
                                {"TDIST_TEST_OP_TIMEOUT_MS", std::to_string(op_timeout.count())}});
  // Let every rank finish a round, then strike rank 1 while the others keep going.
  for (int r = 0; r < world; ++r) store.wait({str("progress/", r)}, Millis(60000));
  const auto struck = std::chrono::steady_clock::now();
  procs.kill(1, f.sig);
  // A death is seen when the connection breaks; a stop only when the operation times out.
  const Millis bound = (f.sig == SIGSTOP ? op_timeout : Millis(0)) + Millis(10000);
  for (int r : {0, 2}) {
    auto result = procs.wait(r, bound + Millis(20000));
    EXPECT_TRUE(result.ok()) << result.describe() << "\n" << result.output;
  }
  const auto took = std::chrono::steady_clock::now() - struck;
  EXPECT_LT(took, bound) << "the survivors took "
                         << std::chrono::duration_cast<Millis>(took).count() << " ms";
  if (f.sig == SIGSTOP) procs.kill(1, SIGKILL);
  auto struck_result = procs.wait(1, Millis(10000));
  EXPECT_FALSE(struck_result.exited) << struck_result.describe();
  EXPECT_EQ(struck_result.signal, f.sig == SIGSTOP ? SIGKILL : f.sig);
}

// A rank dies inside the rendezvous (SIGKILL, SIGTERM, abort()): the others' group creation
// fails naming it within their timeout (3 s) plus 10 s.
class RendezvousFailure : public ::testing::TestWithParam<int> {};

TEST_P(RendezvousFailure, OthersFailNamingTheDeadRank) {
  const int sig = GetParam();
  const Millis timeout(3000);
  TCPStoreServer server("127.0.0.1", 0);
  TCPStore store("127.0.0.1", server.port(), false, Millis(60000));
  tdist::test::Processes procs("comm_rendezvous_child", 3,
                               {{"TDIST_TEST_STORE_PORT", std::to_string(server.port())},
                                {"TDIST_TEST_OP_TIMEOUT_MS", std::to_string(timeout.count())}});
  store.wait({"tdist/pg1/addr/1"}, Millis(60000));  // rank 1 published its address
  procs.kill(1, sig);
  auto struck_result = procs.wait(1, Millis(10000));
  EXPECT_FALSE(struck_result.exited) << struck_result.describe();
  EXPECT_EQ(struck_result.signal, sig);
  const auto struck = std::chrono::steady_clock::now();
  store.set("go", "1");
  const Millis bound = timeout + Millis(10000);
  for (int r : {0, 2}) {
    auto result = procs.wait(r, bound + Millis(20000));
    EXPECT_TRUE(result.ok()) << result.describe() << "\n" << result.output;
    std::cout << result.output;
  }
  const auto took = std::chrono::steady_clock::now() - struck;
  EXPECT_LT(took, bound) << std::chrono::duration_cast<Millis>(took).count() << " ms";
}

INSTANTIATE_TEST_SUITE_P(Signals, RendezvousFailure, ::testing::Values(SIGKILL, SIGTERM, SIGABRT),
                         [](const auto& info) { return std::string(::sigabbrev_np(info.param)); });

std::vector<Fault> faults() {
  std::vector<Fault> out;
  for (const char* op :
       {"allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall", "barrier", "send"}) {
    out.push_back({op, SIGKILL, "auto"});
  }
  for (const char* transport : {"auto", "tcp"}) {
    for (int sig : {SIGKILL, SIGTERM, SIGABRT, SIGSTOP})
      out.push_back({"allreduce", sig, transport});
  }
  out.erase(out.begin() + 7);  // allreduce SIGKILL auto is in the first list already
  // At world 3 the allgathers of run_op (768 KiB blocks) read the peers' memory (Note
  // [Single-copy collectives]): a stopped rank is still readable, so only its missing "done"
  // message can end them.
  out.push_back({"allgather", SIGSTOP, "auto"});
  // So does the allreduce of symmetric memory (Note [Symmetric memory]), with no system call.
  out.push_back({"symmetric_allreduce", SIGKILL, "auto"});
  out.push_back({"symmetric_allreduce", SIGSTOP, "auto"});
  out.push_back({"symmetric_broadcast", SIGKILL, "auto"});
  out.push_back({"symmetric_allgather", SIGKILL, "auto"});
  out.push_back({"symmetric_reduce_scatter", SIGKILL, "auto"});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Matrix, ProcessFailure, ::testing::ValuesIn(faults()),
                         [](const auto& info) {
                           std::ostringstream name;
                           name << info.param;
                           std::string s = name.str();
                           for (char& c : s)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return s;
                         });

}  // namespace
}  // namespace tdist::comm
