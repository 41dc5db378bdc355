// Large tensors between two worker processes of one host through shared-memory slots (Note [RPC
// shared-memory slots] in rpc/detail/shm_tensors.h): this process is worker 0, a child process
// worker 1. What the tests look at is what the kernel shows: which mapping a received tensor's
// bytes live in (/proc/self/maps) and how many slot descriptors a process holds (/proc/self/fd).

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <linux/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dirent.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "tdist/core/env.h"
#include "tdist/core/serialize.h"
#include "tdist/core/tcp_store.h"
#include "tdist/rpc/detail/shm_stream.h"
#include "tdist/rpc/detail/shm_tensors.h"
#include "tests/harness/process.h"
#include "tests/rpc/raw_peer.h"
#include "tests/rpc/rpc_test_util.h"

namespace tdist::rpc::test {
namespace {

using detail::FrameHeader;
using detail::MessageType;

constexpr char kSlotName[] = "/memfd:tdist-rpc-slot";
constexpr char kStreamName[] = "/memfd:tdist-rpc-stream";

// The path of the mapping that holds address p in this process ("" if none).
std::string mapping_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) != 2 || a < lo || a >= hi) continue;
    const auto slash = line.find('/');
    return slash == std::string::npos ? std::string() : line.substr(slash);
  }
  return {};
}

bool in_slot(const at::Tensor& t) { return mapping_of(t.data_ptr()).rfind(kSlotName, 0) == 0; }

// The inodes of the descriptors this process holds whose target starts with `name` (its own
// slots or streams, as a sender).
std::set<ino_t> own_fds(const char* name) {
  std::set<ino_t> own;
  DIR* d = ::opendir("/proc/self/fd");
  while (dirent* e = ::readdir(d)) {
    char target[256] = {};
    const std::string path = std::string("/proc/self/fd/") + e->d_name;
    struct stat st {};
    if (::readlink(path.c_str(), target, sizeof(target) - 1) > 0 &&
        std::strncmp(target, name, std::strlen(name)) == 0 && ::stat(path.c_str(), &st) == 0) {
      own.insert(st.st_ino);
    }
  }
  ::closedir(d);
  return own;
}

int64_t slot_fds() { return static_cast<int64_t>(own_fds(kSlotName).size()); }
int64_t stream_fds() { return static_cast<int64_t>(own_fds(kStreamName).size()); }

// The inodes of the mappings in /proc/self/maps whose path starts with `name`.
std::set<ino_t> mapped(const char* name) {
  std::set<ino_t> out;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    unsigned long inode = 0;
    if (line.find(name) == std::string::npos ||
        std::sscanf(line.c_str(), "%*s %*s %*s %*s %lu", &inode) != 1) {
      continue;
    }
    out.insert(static_cast<ino_t>(inode));
  }
  return out;
}

// Peers' slots this process has mapped: slot mappings whose inode is not one of its own slots',
// counted once each.
int64_t peer_slot_mappings() {
  const std::set<ino_t> own = own_fds(kSlotName);
  int64_t n = 0;
  for (ino_t inode : mapped(kSlotName)) n += own.count(inode) ? 0 : 1;
  return n;
}

// Bytes sent (and acknowledged) and received by every TCP socket of this process so far.
uint64_t tcp_bytes() {
  uint64_t total = 0;
  DIR* d = ::opendir("/proc/self/fd");
  while (dirent* e = ::readdir(d)) {
    const int fd = std::atoi(e->d_name);
    tcp_info info{};
    socklen_t len = sizeof(info);
    if (fd > 2 && ::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) == 0) {
      total += info.tcpi_bytes_acked + info.tcpi_bytes_received;
    }
  }
  ::closedir(d);
  return total;
}

// Shared-memory frame streams this process has mapped (its own rings and its peers').
int64_t stream_mappings() { return static_cast<int64_t>(mapped(kStreamName).size()); }

std::mutex kept_mu;
std::vector<at::Tensor> kept;

void register_shm_functions() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_test_functions();
    register_function("in_slot", [](at::Tensor t) { return in_slot(t); });
    register_function("slot_fds", [] { return slot_fds(); });
    register_function("peer_slot_mappings", [] { return peer_slot_mappings(); });
    register_function("stream_fds", [] { return stream_fds(); });
    register_function("stream_mappings", [] { return stream_mappings(); });
    register_function("echo_text", [](std::string s) { return s; });
    register_function("cpu_seconds", [] { return cpu_seconds(); });
    // Keeps the tensor (its slot stays busy) and returns its sum.
    register_function("keep", [](at::Tensor t) {
      std::lock_guard<std::mutex> lock(kept_mu);
      kept.push_back(t);
      return t.to(at::kDouble).sum().item<double>();
    });
    register_function("total", [](at::Tensor t) { return t.to(at::kDouble).sum().item<double>(); });
    register_function("tensor_and_text", [](at::Tensor t, std::string s) {
      return t.numel() + static_cast<int64_t>(s.size());
    });
    register_function("drop_kept", [] {
      std::lock_guard<std::mutex> lock(kept_mu);
      auto n = static_cast<int64_t>(kept.size());
      kept.clear();
      return n;
    });
  });
}

RpcOptions options(std::shared_ptr<Store> store) {
  RpcOptions o;
  o.store = std::move(store);
  o.rpc_timeout = 60s;
  o.listen_host = "127.0.0.1";
  return o;
}

// Worker 1: serves until worker 0 says it is done.
TDIST_TEST_CHILD(rpc_shm_peer) {
  torch::set_num_threads(1);
  register_shm_functions();
  const auto port = static_cast<uint16_t>(env::require_int("MASTER_PORT", 1, 65535));
  auto store = std::make_shared<TCPStore>("127.0.0.1", port, false, 60s);
  auto agent = RpcAgent::start("w1", 1, 2, options(store));
  store->wait({"shm/done"}, 120s);
  agent->shutdown(true);
  return 0;
}

class RpcSharedMemory : public ::testing::Test {
 protected:
  // Worker 1 in a child process (its environment: `env`), worker 0 here with `shm_bytes` and
  // what `adjust` changes.
  void start(std::map<std::string, std::string> env = {}, int64_t shm_bytes = -1,
             const std::function<void(RpcOptions&)>& adjust = {}) {
    register_shm_functions();
    store_ = std::make_shared<TCPStore>("127.0.0.1", 0, true, 60s);
    env["MASTER_PORT"] = std::to_string(store_->port());
    peer_ = std::make_unique<tdist::test::Processes>("rpc_shm_peer", 1, env);
    auto o = options(store_);
    o.shm_bytes = shm_bytes;
    if (adjust) adjust(o);
    agent_ = RpcAgent::start("w0", 0, 2, o);
  }
  void finish() {
    store_->set("shm/done", "1");
    agent_->shutdown(true);
    auto r = peer_->wait_all(60s);
    EXPECT_TRUE(r[0].ok()) << r[0].describe() << "\n" << r[0].output;
  }
  at::Tensor echo(const at::Tensor& t) { return agent_->rpc_sync<at::Tensor>("w1", "echo", t); }
  // Bytes that this process's TCP sockets sent and received during 50 echoes of 100 KB of text.
  uint64_t tcp_bytes_for_echoes() {
    const std::string text(100000, 'e');
    const uint64_t before = tcp_bytes();
    for (int i = 0; i < 50; ++i) {
      EXPECT_EQ(agent_->rpc_sync<std::string>("w1", "echo_text", text).size(), text.size());
    }
    return tcp_bytes() - before;
  }
  bool peer_got_it_in_a_slot(const at::Tensor& t) {
    return agent_->rpc_sync<bool>("w1", "in_slot", t);
  }
  int64_t peer_slot_fds() { return agent_->rpc_sync<int64_t>("w1", "slot_fds"); }

  std::shared_ptr<TCPStore> store_;
  std::unique_ptr<tdist::test::Processes> peer_;
  std::shared_ptr<RpcAgent> agent_;
};

TEST_F(RpcSharedMemory, LargeTensorsArriveInSlotsBothWaysAndComeBackEqual) {
  start();
  for (auto dtype : {at::kFloat, at::kDouble, at::kLong, at::kByte, at::kBool, at::kComplexFloat}) {
    // The threshold (256 KiB) exactly, an odd size above it, and 16 MiB.
    for (int64_t bytes : {int64_t{256} << 10, (int64_t{1} << 20) + 16, int64_t{16} << 20}) {
      const int64_t n = bytes / c10::elementSize(dtype);
      at::Tensor t =
          dtype == at::kBool ? at::rand({n}) > 0.5 : (at::rand({n}, at::kDouble) * 100).to(dtype);
      at::Tensor back = echo(t);
      ASSERT_TRUE(back.equal(t)) << dtype << " " << bytes;
      EXPECT_TRUE(in_slot(back)) << dtype << " " << bytes << ": " << mapping_of(back.data_ptr());
      EXPECT_TRUE(peer_got_it_in_a_slot(t)) << dtype << " " << bytes;
    }
  }
  // A view with an offset, a transposed (non-contiguous) one and a conjugate one travel as the
  // values they show.
  at::Tensor m = at::rand({1024, 512});
  for (const at::Tensor& v :
       {m.narrow(0, 100, 600), m.t(), at::rand({1 << 17}, at::kComplexFloat).conj()}) {
    at::Tensor back = echo(v);
    EXPECT_TRUE(back.equal(v.resolve_conj().contiguous()));
    EXPECT_TRUE(in_slot(back));
  }
  // Small tensors stay in the frame; several large ones in one message get one slot each.
  at::Tensor small = at::rand({100});
  EXPECT_TRUE(echo(small).equal(small));
  EXPECT_FALSE(in_slot(echo(small)));
  std::vector<at::Tensor> several{at::rand({1 << 18}), small, at::rand({1 << 19}),
                                  at::rand({1 << 18})};
  auto back = agent_->rpc_sync<std::vector<at::Tensor>>("w1", "echo_tensors", several);
  ASSERT_EQ(back.size(), several.size());
  for (size_t i = 0; i < several.size(); ++i) {
    EXPECT_TRUE(back[i].equal(several[i])) << i;
    EXPECT_EQ(in_slot(back[i]), i != 1) << i;
  }
  EXPECT_NE(back[0].data_ptr(), back[2].data_ptr());
  finish();
}

TEST_F(RpcSharedMemory, SlotsAreReleasedAndReused) {
  start();
  at::Tensor t = at::rand({1 << 20});  // 4 MiB
  for (int i = 0; i < 60; ++i) {
    at::Tensor back = echo(t + i);
    ASSERT_TRUE(back.equal(t + i)) << i;
  }
  // Each side needs a slot for the message in flight and one its peer still holds until the next
  // frame carries the release: a few, not one per call.
  EXPECT_LE(slot_fds(), 3);
  EXPECT_LE(peer_slot_fds(), 3);
  EXPECT_GE(slot_fds(), 1);
  finish();
}

TEST_F(RpcSharedMemory, AMessageThatCannotBeSentFreesItsSlots) {
  // Frames of at most 8 MiB: a 4 MiB tensor in a slot with 9 MiB of text cannot go. The slot
  // its tensor was copied into is free again, so the next call needs no other.
  start({}, -1, [](RpcOptions& o) { o.max_frame_bytes = 8 << 20; });
  at::Tensor t = at::rand({1 << 20});
  EXPECT_THROW(agent_->rpc_sync<int64_t>("w1", "tensor_and_text", t, std::string(9 << 20, 'x')),
               InvalidArgument);
  EXPECT_EQ(slot_fds(), 1);
  EXPECT_EQ(agent_->rpc_sync<int64_t>("w1", "tensor_and_text", t, std::string("y")), (1 << 20) + 1);
  EXPECT_EQ(slot_fds(), 1);
  // The calls after it need more only while the peer has not yet released the earlier ones
  // (each release rides on the peer's next frame, which may come before the tensor dies).
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(agent_->rpc_sync<int64_t>("w1", "tensor_and_text", t, std::string("y")),
              (1 << 20) + 1);
  }
  EXPECT_LE(slot_fds(), 3);
  finish();
}

TEST_F(RpcSharedMemory, SlotsRetiredForAMessageThatCannotBeSentAreNamedByTheNextOne) {
  // Our slots may hold 4 MiB and a bit, frames at most 8 MiB. A 2 MiB echo leaves a free slot
  // of ours that the peer has mapped; a 3 MiB tensor retires it to make room, in a message that
  // cannot go (9 MiB of text). The next message names the retired slot, so the peer unmaps it:
  // it holds one mapping of our slots, not two.
  start({}, (int64_t{4} << 20) + (int64_t{64} << 10),
        [](RpcOptions& o) { o.max_frame_bytes = 8 << 20; });
  at::Tensor two = at::rand({1 << 19});
  ASSERT_TRUE(echo(two).equal(two));
  EXPECT_EQ(agent_->rpc_sync<int64_t>("w1", "peer_slot_mappings"), 1);
  at::Tensor three = at::rand({3 << 18});
  EXPECT_THROW(agent_->rpc_sync<int64_t>("w1", "tensor_and_text", three, std::string(9 << 20, 'x')),
               InvalidArgument);
  EXPECT_EQ(agent_->rpc_sync<int64_t>("w1", "tensor_and_text", three, std::string("y")),
            (3 << 18) + 1);
  EXPECT_EQ(agent_->rpc_sync<int64_t>("w1", "peer_slot_mappings"), 1);
  EXPECT_EQ(slot_fds(), 1);
  finish();
}

TEST_F(RpcSharedMemory, AReceivedTensorIsTheUsersToChangeAndOutlivesItsSender) {
  start();
  at::Tensor t = at::rand({1 << 20});
  at::Tensor a = echo(t);
  ASSERT_TRUE(in_slot(a));
  a.add_(1);  // in place, in the slot: the peer does not reuse a slot we still hold
  at::Tensor b = echo(t);
  EXPECT_NE(a.data_ptr(), b.data_ptr());
  EXPECT_TRUE(b.equal(t));
  EXPECT_TRUE(a.equal(t + 1));
  // Growing it copies it out of the slot.
  a.resize_({2 << 20});
  EXPECT_FALSE(in_slot(a));
  EXPECT_TRUE(a.narrow(0, 0, 1 << 20).equal(t + 1));
  // The sender's process ends: what we received stays readable and writable.
  finish();
  EXPECT_TRUE(in_slot(b));
  EXPECT_TRUE(b.equal(t));
  b.mul_(2);
  EXPECT_TRUE(b.equal(t * 2));
}

TEST_F(RpcSharedMemory, SlotsHeldByTheReceiverAndAFullCapFallBackToProcessVmReadv) {
  // Our slots may hold 6 MiB and a bit: three 2 MiB tensors that the peer keeps fill them, the
  // next ones go by process_vm_readv. All arrive whole.
  start({}, (int64_t{6} << 20) + (int64_t{64} << 10));
  std::vector<at::Tensor> sent;
  for (int i = 0; i < 5; ++i) {
    sent.push_back(at::rand({1 << 19}));
    EXPECT_EQ(agent_->rpc_sync<double>("w1", "keep", sent.back()),
              sent.back().to(at::kDouble).sum().item<double>())
        << i;
    EXPECT_LE(slot_fds(), 3) << i;
  }
  EXPECT_EQ(agent_->rpc_sync<int64_t>("w1", "drop_kept"), 5);
  // Released (with the peer's next frame) and reused, and other sizes: the least recently used
  // free slots are retired to make room, and the peer drops its mappings of them.
  for (int i = 0; i < 12; ++i) {
    at::Tensor t = at::rand({(i % 3 + 1) << 18});  // 1, 2, 3 MiB
    at::Tensor back = echo(t);
    ASSERT_TRUE(back.equal(t)) << i;
    EXPECT_TRUE(in_slot(back)) << i;
    EXPECT_LE(slot_fds(), 5) << i;  // the cap over the smallest slot
  }
  finish();
}

TEST_F(RpcSharedMemory, ZeroBytesOfSlotsMeansProcessVmReadvOnly) {
  start({{"TDIST_RPC_SHM_BYTES", "0"}}, 0);
  at::Tensor t = at::rand({1 << 20});
  for (int i = 0; i < 3; ++i) {
    at::Tensor back = echo(t);
    EXPECT_TRUE(back.equal(t));
    EXPECT_FALSE(in_slot(back));
    EXPECT_FALSE(peer_got_it_in_a_slot(t));
  }
  EXPECT_EQ(slot_fds(), 0);
  EXPECT_EQ(peer_slot_fds(), 0);
  finish();
}

// ---- frames through shared-memory rings (Note [RPC shared-memory frame streams]) -------------

// Calls of every size through rings of 4 KiB, the smallest: nearly every frame wraps around the
// ring, and a frame larger than the ring goes through it in pieces while the reader empties it.
// Four threads call at once, so writers of one connection take turns at the ring.
TEST_F(RpcSharedMemory, FramesBetweenWorkersOfOneHostGoThroughSharedMemoryRings) {
  start({{"TDIST_RPC_STREAM_BYTES", "4096"}}, -1, [](RpcOptions& o) { o.stream_bytes = 4096; });
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{4055}, size_t{4096}, size_t{4097},
                       size_t{100000}, size_t{3} << 20}) {
    std::string text(bytes, 'a');
    for (size_t i = 0; i < bytes; ++i) text[i] = static_cast<char>('a' + i % 23);
    ASSERT_EQ(agent_->rpc_sync<std::string>("w1", "echo_text", text), text) << bytes;
  }
  // Tensors in the frame (below the slots' threshold) and in slots.
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{50000}, int64_t{1} << 20}) {
    at::Tensor t = at::rand({n});
    ASSERT_TRUE(echo(t).equal(t)) << n;
  }
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (int64_t i = 0; i < 200; ++i) {
        const std::string text(static_cast<size_t>((i * 977 + k * 131) % 9000),
                               static_cast<char>('A' + k));
        if (agent_->rpc_sync<std::string>("w1", "echo_text", text) != text) ++wrong;
        if (agent_->rpc_sync<int64_t>("w1", "add", i, int64_t{k}) != i + k) ++wrong;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  // Each side made a ring for what it sends and mapped its peer's; the descriptor of a ring is
  // closed once its reader accepted it, so none is left open.
  EXPECT_GE(stream_mappings(), 2);
  EXPECT_GE(agent_->rpc_sync<int64_t>("w1", "stream_mappings"), 2);
  EXPECT_EQ(stream_fds(), 0);
  EXPECT_EQ(agent_->rpc_sync<int64_t>("w1", "stream_fds"), 0);
  // And the frames no longer cross TCP: 50 calls of 100 KB each way move a few bytes there.
  EXPECT_LT(tcp_bytes_for_echoes(), 100000u);
  finish();
}

TEST_F(RpcSharedMemory, ZeroStreamBytesKeepsFramesOnTcp) {
  start({{"TDIST_RPC_STREAM_BYTES", "0"}}, -1, [](RpcOptions& o) { o.stream_bytes = 0; });
  for (int64_t i = 0; i < 20; ++i) {
    EXPECT_EQ(agent_->rpc_sync<int64_t>("w1", "add", i, int64_t{1}), i + 1);
  }
  EXPECT_EQ(stream_mappings(), 0);
  EXPECT_EQ(agent_->rpc_sync<int64_t>("w1", "stream_mappings"), 0);
  EXPECT_GE(tcp_bytes_for_echoes(), 2u * 50 * 100000);
  finish();
}

// Readers of rings sleep once idle: after calls both ways (every ring of both workers in use,
// their readers spinning between frames), neither process burns a core.
TEST_F(RpcSharedMemory, IdleWorkersReadingRingsBurnNoCore) {
  start({{"TDIST_RPC_SPIN_US", "2000"}}, -1, [](RpcOptions& o) { o.spin_us = 2000; });
  for (int64_t i = 0; i < 200; ++i) {
    ASSERT_EQ(agent_->rpc_sync<int64_t>("w1", "add", i, int64_t{1}), i + 1);
    ASSERT_EQ(agent_->rpc_sync<int64_t>("w1", "relay", std::string("w0"), i), (i + 1) * 10);
  }
  std::this_thread::sleep_for(50ms);
  const double ours = cpu_seconds();
  const double theirs = agent_->rpc_sync<double>("w1", "cpu_seconds");
  std::this_thread::sleep_for(1s);
  EXPECT_LT(cpu_seconds() - ours, 0.2);
  EXPECT_LT(agent_->rpc_sync<double>("w1", "cpu_seconds") - theirs, 0.2);
  EXPECT_GE(stream_mappings(), 4);  // both connections, both ways
  finish();
}

// A peer that stops (SIGSTOP) reads nothing: a message larger than the ring fills it and the
// writer gives up after the send timeout (the RPC timeout), as it does on a full socket. The
// call times out: its deadline and the send's are the same 2 s, and the connection the writer
// closes fails a call past its deadline with TimeoutError too (before, with NetworkError when
// the close came first: once under ASan in a cold CI run).
TEST_F(RpcSharedMemory, AWriterOfAFullRingTimesOutWhenThePeerStopsReading) {
  start({{"TDIST_RPC_STREAM_BYTES", "4096"}}, -1, [](RpcOptions& o) {
    o.stream_bytes = 4096;
    o.rpc_timeout = 2s;
  });
  ASSERT_EQ(agent_->rpc_sync<int64_t>("w1", "add", int64_t{1}, int64_t{2}), 3);
  peer_->kill(0, SIGSTOP);
  EXPECT_THROW(agent_->rpc_sync<std::string>("w1", "echo_text", std::string(1 << 20, 'x')),
               TimeoutError);
  peer_->kill(0, SIGKILL);
  agent_->shutdown(false);
  peer_->wait_all(60s);
}

// One ring, both ends in this process: bytes come out in order across the wrap-around, a full
// ring takes nothing more, and counters the peer could not have published are refused when
// they are read.
TEST(RpcSharedMemoryChecks, StreamRingsWrapAroundAndRefuseImpossibleCounters) {
  auto w = detail::ShmStream::create(detail::kMinStreamBytes);
  ASSERT_TRUE(w);
  std::string why;
  auto r = detail::ShmStream::open(::getpid(), w->fd(), w->tag(), w->capacity(), &why);
  ASSERT_TRUE(r) << why;
  EXPECT_THROW(detail::ShmStream::open(::getpid(), w->fd(), w->tag() + 1, w->capacity(), &why),
               ProtocolError);
  std::vector<uint8_t> in(3000), out(3000);
  for (int i = 0; i < 10; ++i) {  // 30000 bytes through 4096: the ring wraps seven times
    for (size_t k = 0; k < in.size(); ++k) in[k] = static_cast<uint8_t>(i * 31 + k);
    ASSERT_EQ(w->write_some(in.data(), in.size()), in.size());
    EXPECT_EQ(r->read_some(out.data(), 1000), 1000u);
    EXPECT_EQ(r->read_some(out.data() + 1000, out.size()), 2000u);
    EXPECT_EQ(out, in) << i;
    EXPECT_EQ(r->read_some(out.data(), 1), 0u);
  }
  EXPECT_EQ(w->write_some(in.data(), in.size()), in.size());
  EXPECT_EQ(w->write_some(in.data(), in.size()), 4096u - 3000u);  // full
  EXPECT_EQ(w->write_some(in.data(), 1), 0u);
  r->wait(0);  // looks, does not sleep
  // A reader's tail ahead of what was written, a writer's head beyond a ring's worth.
  auto& shared = *w->shared();
  const uint64_t head = shared.head.load();
  shared.tail.store(head + 1);
  EXPECT_THROW(w->write_some(in.data(), 1), ProtocolError);
  shared.head.store(head + 5000);
  EXPECT_THROW(r->read_some(out.data(), 1), ProtocolError);
  EXPECT_THROW(detail::ShmStream::open(::getpid(), w->fd(), w->tag(), 100, &why), ProtocolError);

  // The writer loads the tail only when the room it last saw cannot take a write: a lying tail
  // is not read by a write that fits, and fails the first one that needs it.
  auto w2 = detail::ShmStream::create(detail::kMinStreamBytes);
  ASSERT_TRUE(w2);
  ASSERT_EQ(w2->write_some(in.data(), 100), 100u);
  w2->shared()->tail.store(5000);  // ahead of the 100 bytes written
  EXPECT_EQ(w2->write_some(in.data(), 10), 10u);
  EXPECT_THROW(w2->write_some(in.data(), 4000), ProtocolError);
}

TEST(RpcSharedMemoryChecks, AStreamSizeOutOfRangeIsRefused) {
  for (int64_t bytes : {int64_t{-2}, int64_t{100}, int64_t{1} << 40}) {
    RpcOptions o;
    o.stream_bytes = bytes;
    try {
      start_agents(1, o);
      ADD_FAILURE() << "stream_bytes " << bytes << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("stream_bytes"), std::string::npos) << e.what();
    }
  }
}

// A raw peer in a child process offers shared-memory streams that lie, and one that does not;
// exit 0 when the worker closed the connection for each lie and answered the honest stream.
TDIST_TEST_CHILD(rpc_lying_stream_peer) {
  const auto port = static_cast<uint16_t>(env::require_int("AGENT_PORT", 1, 65535));
  auto connect = [&] {
    const int sock = connect_raw(port);
    return forged_handshake(sock, "", 0, ::getpid()) ? sock : -1;
  };
  auto offer = [](int sock, int fd, uint64_t tag, uint64_t capacity) {
    FrameHeader h;
    h.type = MessageType::kStreamOffer;
    h.id = tag;
    const Bytes body = encode(detail::StreamOffer{fd, capacity});
    h.body_len = static_cast<uint32_t>(body.size());
    h.length = body.size();
    send_frame(sock, h, body);
  };
  auto control = [](int sock, MessageType type, uint64_t id) {
    FrameHeader h;
    h.type = type;
    h.id = id;
    send_frame(sock, h, {});
  };
  // Offers the ring, waits for its acceptance and switches to it.
  auto switch_to = [&](int sock, detail::ShmStream& ring) {
    offer(sock, ring.fd(), ring.tag(), ring.capacity());
    std::vector<uint8_t> body;
    const FrameHeader a = read_frame(sock, &body);
    if (a.type != MessageType::kStreamAccept || a.id != ring.tag()) return false;
    control(sock, MessageType::kStreamSwitch, ring.tag());
    return true;
  };
  auto write_all = [](detail::ShmStream& ring, const std::vector<uint8_t>& bytes) {
    for (size_t done = 0; done < bytes.size();) {
      done += ring.write_some(bytes.data() + done, bytes.size() - done);
    }
  };
  const int slot_named = ::memfd_create("tdist-rpc-slot", MFD_CLOEXEC);
  if (::ftruncate(slot_named, 1 << 20) != 0) return 2;
  struct Lie {
    const char* what;
    std::function<void(int sock, detail::ShmStream& ring)> tell;
  };
  const std::vector<Lie> lies{
      {"a descriptor that is not a stream",
       [&](int sock, detail::ShmStream&) { offer(sock, slot_named, 1, 4096); }},
      {"a capacity below the smallest",
       [&](int sock, detail::ShmStream& ring) { offer(sock, ring.fd(), ring.tag(), 100); }},
      {"a tag that is not the ring's",
       [&](int sock, detail::ShmStream& ring) { offer(sock, ring.fd(), ring.tag() + 1, 4096); }},
      {"a switch to a ring never offered",
       [&](int sock, detail::ShmStream& ring) {
         control(sock, MessageType::kStreamSwitch, ring.tag());
       }},
      {"an acceptance of a ring never offered",
       [&](int sock, detail::ShmStream&) { control(sock, MessageType::kStreamAccept, 99); }},
      {"a head beyond the ring",
       [&](int sock, detail::ShmStream& ring) {
         if (!switch_to(sock, ring)) return;
         ring.shared()->head.store(ring.capacity() + 1);
         ring.shared()->reader_bell.fetch_add(1);
       }},
      {"half a frame in the ring, then nothing (the RPC timeout, 2 s, passes)",
       [&](int sock, detail::ShmStream& ring) {
         if (!switch_to(sock, ring)) return;
         std::vector<uint8_t> body;
         std::vector<uint8_t> half = header_bytes(add_call(3, &body));
         half.resize(half.size() / 2);
         write_all(ring, half);
       }},
      {"a byte on the socket after the switch",
       [&](int sock, detail::ShmStream& ring) {
         if (!switch_to(sock, ring)) return;
         send_bytes(sock, "x", 1);
       }},
  };
  for (const Lie& lie : lies) {
    const int sock = connect();
    if (sock < 0) return 3;  // not granted the fast path
    auto ring = detail::ShmStream::create(4096);
    if (!ring) return 4;
    lie.tell(sock, *ring);
    if (!closed_by_peer(sock)) {
      std::fprintf(stderr, "the worker kept the connection after %s\n", lie.what);
      return 5;
    }
    ::close(sock);
  }
  // The honest stream: a call written into the ring is answered (on the socket: a raw peer
  // never accepts the worker's own offer).
  const int sock = connect();
  auto ring = detail::ShmStream::create(4096);
  if (sock < 0 || !ring || !switch_to(sock, *ring)) return 6;
  std::vector<uint8_t> body;
  const FrameHeader call = add_call(7, &body);
  std::vector<uint8_t> bytes = header_bytes(call);
  bytes.insert(bytes.end(), body.begin(), body.end());
  write_all(*ring, bytes);
  const FrameHeader r = read_frame(sock, &body);
  if (r.type != MessageType::kResponse || r.id != 7 || decode<int64_t>(body) != 42) return 7;
  ::close(sock);
  return 0;
}

TEST(RpcSharedMemoryChecks, StreamOffersAndSwitchesThatLieCloseTheConnection) {
  register_shm_functions();
  RpcOptions o;
  o.rpc_timeout = 2s;
  auto a = start_agents(2, o);
  expect_raw_peer_passes("rpc_lying_stream_peer", a[1]->port());
  EXPECT_EQ(a[0]->rpc_sync<int64_t>("w1", "add", int64_t{2}, int64_t{3}), 5);
  shutdown_all(a);
}

TEST(RpcSharedMemoryChecks, SlotNamesInAFrameAreChecked) {
  auto check = [](detail::TensorSection s, uint32_t flags) {
    FrameHeader h;
    h.flags = flags;
    h.length = h.body_len = 0;
    detail::check_tensor_section(h, s, true, uint64_t{1} << 32);
  };
  const TensorMeta meta{static_cast<int8_t>(c10::ScalarType::Float), {1 << 18}, uint64_t{1} << 20};
  detail::TensorSection ok;
  ok.metas = {meta};
  ok.addresses = {4096};
  ok.shm = {{5, 77}};
  EXPECT_NO_THROW(check(ok, detail::kFlagRemoteTensors));
  auto bad = ok;
  bad.addresses.clear();  // slot names without addresses
  EXPECT_THROW(check(bad, detail::kFlagRemoteTensors), ProtocolError);
  bad = ok;
  bad.shm.push_back({6, 78});  // more names than tensors
  EXPECT_THROW(check(bad, detail::kFlagRemoteTensors), ProtocolError);
  bad = ok;
  bad.addresses = {0};  // a slot tensor whose bytes are said to be in the frame
  EXPECT_THROW(check(bad, detail::kFlagRemoteTensors), ProtocolError);
  bad = ok;
  bad.retired.assign(detail::kMaxRetired + 1, 9);
  EXPECT_THROW(check(bad, detail::kFlagRemoteTensors), ProtocolError);
  EXPECT_THROW(check(ok, 0), ProtocolError);  // without the remote-tensors flag
}

// The sender side alone: slots are made, reused by size, retired least recently used first to
// stay under the cap, and refused when every slot is busy.
TEST(RpcSharedMemoryChecks, SlotsStayUnderTheCap) {
  const uint64_t mib = uint64_t{1} << 20;
  detail::ShmSlots slots(3 * (mib + detail::kShmHeaderBytes));
  std::vector<uint8_t> src(2 * mib, 7);
  auto a = slots.put(src.data(), mib);
  auto b = slots.put(src.data(), mib);
  ASSERT_TRUE(a && b);
  EXPECT_NE(a->ref.tag, b->ref.tag);
  EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(a->address), src.data(), mib), 0);
  EXPECT_TRUE(slots.release(a->ref.tag));
  EXPECT_FALSE(slots.release(a->ref.tag));    // twice: ignored
  auto c = slots.put(src.data(), mib - 100);  // reuses a's slot
  ASSERT_TRUE(c);
  EXPECT_EQ(c->ref.tag, a->ref.tag);
  auto d = slots.put(src.data(), mib);
  ASSERT_TRUE(d);
  EXPECT_FALSE(slots.put(src.data(), mib));  // three busy slots fill the cap
  EXPECT_TRUE(slots.take_retired(100).empty());
  EXPECT_TRUE(slots.release(b->ref.tag));
  EXPECT_TRUE(slots.release(d->ref.tag));
  auto e = slots.put(src.data(), 2 * mib);  // retires b's then d's slot (b is older)
  ASSERT_TRUE(e);
  EXPECT_EQ(slots.take_retired(1), std::vector<uint64_t>{b->ref.tag});  // at most one at a time
  EXPECT_EQ(slots.take_retired(100), std::vector<uint64_t>{d->ref.tag});
  slots.untake_retired({d->ref.tag});  // a frame that failed: named by the next one
  EXPECT_EQ(slots.take_retired(100), std::vector<uint64_t>{d->ref.tag});
  EXPECT_TRUE(slots.take_retired(100).empty());
  EXPECT_EQ(slots.busy(), 2u);
  EXPECT_LE(slots.bytes_held(), 3 * (mib + detail::kShmHeaderBytes));
}

// Each slot keeps a descriptor open: all the connections of a process together hold at most
// kMaxProcessSlots, and a connection makes room by retiring its own free slots only.
TEST(RpcSharedMemoryChecks, SlotsOfAllConnectionsStayUnderTheProcessBudget) {
  const int64_t before = detail::ShmSlots::process_slots();
  const uint64_t page = 4096;
  std::vector<uint8_t> src(3 * page, 1);
  {
    detail::ShmSlots a(uint64_t{1} << 30), b(uint64_t{1} << 30);
    std::vector<uint64_t> tags;
    while (auto p = a.put(src.data(), page)) {
      tags.push_back(p->ref.tag);
      if (tags.size() > 1000) break;
    }
    EXPECT_EQ(before + static_cast<int64_t>(tags.size()), detail::kMaxProcessSlots);
    EXPECT_EQ(detail::ShmSlots::process_slots(), detail::kMaxProcessSlots);
    EXPECT_FALSE(b.put(src.data(), page));
    ASSERT_TRUE(a.release(tags[0]));
    ASSERT_TRUE(a.release(tags[1]));
    EXPECT_FALSE(b.put(src.data(), page));  // a's free slots are not b's to retire
    EXPECT_TRUE(a.take_retired(100).empty());
    EXPECT_TRUE(b.take_retired(100).empty());
    auto c = a.put(src.data(), 3 * page);  // no free slot fits: the oldest free goes
    ASSERT_TRUE(c);
    EXPECT_EQ(a.take_retired(100), std::vector<uint64_t>{tags[0]});
    EXPECT_EQ(detail::ShmSlots::process_slots(), detail::kMaxProcessSlots);
  }
  EXPECT_EQ(detail::ShmSlots::process_slots(), before);
}

// A peer that names, as a slot, a descriptor that is not one: the receiving worker closes the
// connection and goes on serving. The raw peer runs in a child process (the fast path is for
// other processes); exit 0 when the worker closed the connection for each lie.
TDIST_TEST_CHILD(rpc_lying_slot_peer) {
  const auto port = static_cast<uint16_t>(env::require_int("AGENT_PORT", 1, 65535));
  std::vector<uint8_t> buf(1 << 20, 1);
  // An ordinary file, a memfd named like a slot whose header is not a slot's, and one whose
  // header is right but that could still shrink under the receiver's mapping (no seals).
  char path[] = "/tmp/tdist-rpc-shm-test-XXXXXX";
  const int file = ::mkstemp(path);
  ::unlink(path);
  if (::ftruncate(file, 2 << 20) != 0) return 5;
  const int fake = ::memfd_create("tdist-rpc-slot", MFD_CLOEXEC);
  if (::ftruncate(fake, 2 << 20) != 0) return 6;
  const int unsealed = ::memfd_create("tdist-rpc-slot", MFD_CLOEXEC);
  const uint64_t header[3] = {detail::kShmSlotMagic, 12345, 1 << 20};
  if (::ftruncate(unsealed, detail::kShmHeaderBytes + (1 << 20)) != 0 ||
      ::pwrite(unsealed, header, sizeof(header), 0) != sizeof(header)) {
    return 7;
  }
  for (int fd : {file, fake, unsealed}) {
    int sock = connect_raw(port);
    if (!forged_handshake(sock, "", 0, ::getpid())) return 3;  // not granted the fast path
    detail::TensorSection s;
    s.metas = {TensorMeta{static_cast<int8_t>(c10::ScalarType::Byte), {1 << 20}, 1u << 20}};
    s.addresses = {reinterpret_cast<uint64_t>(buf.data())};
    s.shm = {{fd, 12345}};
    std::vector<uint8_t> body;
    FrameHeader h = add_call(1, &body);
    add_tensor_section(h, body, s);
    auto bytes = header_bytes(h);
    bytes.insert(bytes.end(), body.begin(), body.end());
    send_bytes(sock, bytes.data(), bytes.size());
    if (!closed_by_peer(sock)) return 4;
    ::close(sock);
  }
  return 0;
}

// A slot the receiver cannot see (here: a descriptor the sender does not have, as when /proc
// hides other processes): the worker reads the tensor from the address the frame also gives,
// answers, and releases the slot with its answer. Exit 0 when all of that happened.
TDIST_TEST_CHILD(rpc_unseen_slot_peer) {
  const auto port = static_cast<uint16_t>(env::require_int("AGENT_PORT", 1, 65535));
  int sock = connect_raw(port);
  if (!forged_handshake(sock, "", 0, ::getpid())) return 3;
  at::Tensor t = at::arange(1 << 18, at::kFloat);  // 1 MiB
  detail::OutMessage m = detail::encode_message(
      MessageType::kCall, nullptr, 1,
      std::make_tuple(detail::CallHeader{"total", signature_of<double, at::Tensor>().hash}), t);
  detail::TensorSection s;
  s.metas = {describe_tensor(t)};
  s.addresses = {reinterpret_cast<uint64_t>(t.data_ptr())};
  s.shm = {{987654, 4242}};
  FrameHeader h;
  h.type = MessageType::kCall;
  h.id = 7;
  add_tensor_section(h, m.body, s);
  send_frame(sock, h, m.body);
  std::vector<uint8_t> body;
  FrameHeader r = read_frame(sock, &body);
  if (r.type != MessageType::kResponse || r.id != 7) return 4;
  const double want = t.to(at::kDouble).sum().item<double>();
  if (decode<double>(body) != want) return 5;
  r = read_frame(sock, &body);
  if (r.type != MessageType::kShmRelease || r.id != 4242 || r.length != 0) return 6;
  ::close(sock);
  return 0;
}

TEST(RpcSharedMemoryChecks, ASlotTheReceiverCannotSeeIsReadFromTheSendersMemory) {
  register_shm_functions();
  auto a = start_agents(2);
  expect_raw_peer_passes("rpc_unseen_slot_peer", a[1]->port());
  shutdown_all(a);
}

TEST(RpcSharedMemoryChecks, ADescriptorThatIsNotASlotClosesTheConnection) {
  register_shm_functions();
  auto a = start_agents(2);
  expect_raw_peer_passes("rpc_lying_slot_peer", a[1]->port());
  EXPECT_EQ(a[0]->rpc_sync<int64_t>("w1", "add", int64_t{2}, int64_t{3}), 5);
  shutdown_all(a);
}

}  // namespace
}  // namespace tdist::rpc::test
