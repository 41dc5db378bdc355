// What a same-host peer must not be able to do through the shared-memory negotiation (Note
// [Shared-memory negotiation] in comm/transport/channels.h; issue 41, items 1 and 10). The
// victim is this process (one rank of a two-rank mesh); the hostile peer is a child process
// (tests/harness/process.h) that speaks the negotiation by hand.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tdist/comm/transport/channels.h"
#include "tdist/comm/transport/shm/local_link.h"
#include "tdist/comm/transport/shm/shm_channel.h"
#include "tdist/comm/transport/tcp/mesh.h"
#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/file_store.h"
#include "tdist/core/wire.h"
#include "tests/harness/process.h"

namespace tdist::comm {
namespace {

using namespace std::chrono_literals;

constexpr uint32_t kMagic = 0x32534454;  // "TDS2"
const std::string kHost = "channels-test-host";
// A FileStore names no host, so the mesh listens beyond loopback: that needs a token (Note
// [Secure by default] in core/token.h).
const std::string kToken = "channels-test-token";

std::chrono::steady_clock::time_point soon() { return std::chrono::steady_clock::now() + 30s; }
uint64_t group() { return tcp::fnv1a("channels-test"); }

std::unique_ptr<tcp::Mesh> join_mesh(const std::string& store_path, int rank) {
  FileStore store(store_path);
  return std::make_unique<tcp::Mesh>(store, rank, 2, 1, group(), kToken, soon());
}

void send(tcp::Connection* conn, const Bytes& b) {
  conn->write_all(b.data(), b.size(), soon(), "test bytes");
}

void append_host(wire::Writer& w) {
  w.u32(static_cast<uint32_t>(kHost.size()));
  w.raw(kHost.data(), kHost.size());
}

// The victim's side: joins the mesh as `rank`, negotiates, and returns its channels.
struct Victim {
  std::string dir = tdist::test::temp_dir("tdist-channels");
  std::string store = dir + "/store";
  std::unique_ptr<tcp::Mesh> mesh;
  Channels channels;

  void negotiate(int rank, size_t capacity = size_t{2} << 20) {
    mesh = join_mesh(store, rank);
    ChannelOptions o;
    o.host = kHost;
    o.shm_capacity = capacity;
    channels = make_channels(*mesh, 0, o, soon());
  }
  bool uses_shm_with(int peer) const {
    return dynamic_cast<shm::ShmChannel*>(channels.peers[peer].get()) != nullptr;
  }
};

// Reads until the peer closes the connection (the victim is done with it).
void wait_for_end(tcp::Connection* conn) {
  try {
    for (;;) {
      uint8_t b;
      conn->read_all(&b, 1, std::chrono::steady_clock::now() + 60s, "the end");
    }
  } catch (const Error&) {}
}

struct OfferRead {
  uint64_t capacity = 0;
  std::string name;
  Bytes nonce;
};

// Reads the lower rank's offer (Note [Shared-memory negotiation], step 1).
OfferRead read_offer(tcp::Connection* conn) {
  uint8_t head[16];
  conn->read_all(head, sizeof(head), soon(), "offer");
  wire::Reader r(head, sizeof(head));
  TDIST_CHECK_EQ(r.u32(), kMagic);
  OfferRead o;
  o.capacity = r.u64();
  o.name.assign(r.u32(), '\0');
  conn->read_all(o.name.data(), o.name.size(), soon(), "name");
  if (!o.name.empty()) {
    o.nonce.resize(32);
    conn->read_all(o.nonce.data(), o.nonce.size(), soon(), "nonce");
  }
  uint8_t len[4];
  conn->read_all(len, 4, soon(), "host length");
  std::string host(wire::Reader(len, 4).u32(), '\0');
  conn->read_all(host.data(), host.size(), soon(), "host");
  return o;
}

Bytes hello_of(const Bytes& nonce, int lower, int higher) {
  Bytes hello(nonce);
  wire::Writer w(hello);
  w.u32(static_cast<uint32_t>(lower));
  w.u32(static_cast<uint32_t>(higher));
  w.u64(0);  // the group: ChannelOptions::group's default
  return hello;
}

// ---- item 1: the peer's process ----------------------------------------------------------------

// Rank 1 of the victim's mesh, a process of its own that would like to pass for the victim's
// process. On 4622ec6 it could: the answer carried a pid and canary, and echoing the victim's
// own (from the victim's offer) made the victim record its own pid as the peer's. Now no field
// names a process: the best it can do is take part honestly, and the victim asks the kernel.
TDIST_TEST_CHILD(channels_forged_process) {
  auto mesh = join_mesh(env::require("STORE"), 1);
  auto* conn = mesh->get(0, 0);
  const OfferRead offer = read_offer(conn);
  std::string why;
  const Bytes hello = hello_of(offer.nonce, 0, 1);
  const int link = shm::connect_link(offer.name, hello, &why);
  Bytes answer{static_cast<uint8_t>(link >= 0 ? 1 : 0)};
  wire::Writer w(answer);
  append_host(w);
  send(conn, answer);
  uint8_t sent = 0;
  conn->read_all(&sent, 1, soon(), "sent");
  Bytes got(hello.size());
  const int fd = sent == 1 ? shm::receive_with_fd(link, got.data(), got.size(), &why) : -1;
  send(conn, Bytes{static_cast<uint8_t>(fd >= 0 ? 1 : 0)});
  wait_for_end(conn);
  return 0;
}

// The victim never takes its own process for the peer's: if it did, a broadcast rooted at it
// would write its data into its own memory at an address the peer chose. What it records is the
// kernel's word: the child's pid (when the kernel lets it read the child).
TEST(ChannelSecurity, APeerCannotPassForTheVictimsOwnProcess) {
  Victim v;
  tdist::test::Processes peer("channels_forged_process", 1, {{"STORE", v.store}});
  v.negotiate(0);
  EXPECT_TRUE(v.uses_shm_with(1));
  EXPECT_NE(v.channels.readable_pids[1], ::getpid());
  if (v.channels.readable_pids[1] != 0) {
    EXPECT_EQ(v.channels.readable_pids[1], peer.pid(0));
  }
  v.mesh->shutdown_all();
  auto r = peer.wait_all(60s);
  EXPECT_TRUE(r[0].ok()) << r[0].describe() << "\n" << r[0].output;
}

// Ranks that are threads of one process share rings, but none reads another's memory: the
// kernel names our own process at the other end of every link.
TEST(ChannelSecurity, RanksInOneProcessShareRingsButNeverReadEachOther) {
  const std::string dir = tdist::test::temp_dir("tdist-channels");
  std::vector<Victim> ranks(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      FileStore store(dir + "/store");
      ranks[r].mesh = std::make_unique<tcp::Mesh>(store, r, 3, 1, group(), kToken, soon());
      ChannelOptions o;
      o.host = kHost;
      ranks[r].channels = make_channels(*ranks[r].mesh, 0, o, soon());
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    for (int p = 0; p < 3; ++p) {
      if (p == r) continue;
      EXPECT_TRUE(ranks[r].uses_shm_with(p)) << r << " " << p;
      EXPECT_EQ(ranks[r].channels.readable_pids[p], 0) << r << " " << p;
    }
  }
}

// ---- items 1 and 10: the segment the peer offers ----------------------------------------------

// Rank 0 (the lower rank, which offers the segment) of the victim's mesh. ATTACK:
//   "none":      an honest offer (what the others change one thing of);
//   "other_uid": a segment owned by another user (nobody);
//   "open_mode": a segment of our user that everyone may open (0666);
//   "too_large": a ring of 16 MiB to a victim that agreed to 2 MiB;
//   "wrong_size": a ring of 2 MiB in a segment of 16 MiB;
//   "other_pair": an honest segment behind a link that answers with another pair's hello;
//   "shrink":    a segment not sealed, cut to nothing once the victim answered (then one byte
//                on the connection tells the victim to use the channel).
TDIST_TEST_CHILD(channels_hostile_segment) {
  const std::string attack = env::require("ATTACK");
  auto mesh = join_mesh(env::require("STORE"), 0);
  auto* conn = mesh->get(0, 1);
  const uint64_t capacity = attack == "too_large" ? uint64_t{16} << 20 : uint64_t{2} << 20;
  const size_t bytes = attack == "wrong_size" ? shm::segment_bytes(uint64_t{16} << 20)
                                              : shm::segment_bytes(capacity);
  const int fd = ::memfd_create("tdist-hostile", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0 || ::fchmod(fd, 0600) != 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    return 10;
  }
  if (attack == "other_uid" && ::fchown(fd, 65534, 65534) != 0) return 11;
  if (attack == "open_mode" && ::fchmod(fd, 0666) != 0) return 12;
  if (attack != "shrink" &&
      ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return 13;
  }
  std::string why;
  auto listener = shm::LinkListener::open(&why);
  if (!listener) return 14;
  Bytes nonce(32, 7);
  Bytes offer;
  wire::Writer w(offer);
  w.u32(kMagic);
  w.u64(capacity);
  w.u32(static_cast<uint32_t>(listener->name().size()));
  w.raw(listener->name().data(), listener->name().size());
  w.raw(nonce.data(), nonce.size());
  append_host(w);
  send(conn, offer);
  uint8_t answer[1 + 4 + 64];
  conn->read_all(answer, 1 + 4 + kHost.size(), soon(), "answer");
  bool sent = false;
  if (answer[0] == 1) {
    const Bytes hello = hello_of(nonce, 0, 1);
    const int link = listener->accept_hello(hello, &why);
    // "other_pair": the link answers with another pair's hello, as a link relayed from another
    // pair (made by another process for rank 0 and rank 2) would.
    const Bytes reply = attack == "other_pair" ? hello_of(nonce, 0, 2) : hello;
    sent = link >= 0 && shm::send_with_fd(link, reply, fd, &why);
  }
  send(conn, Bytes{static_cast<uint8_t>(sent ? 1 : 0)});
  uint8_t mapped = 0;
  conn->read_all(&mapped, 1, soon(), "mapped");
  if (attack == "shrink") {
    if (::ftruncate(fd, 0) != 0) return 15;
    send(conn, Bytes{1});
  }
  wait_for_end(conn);
  return 0;
}

void expect_refused(const std::string& attack) {
  Victim v;
  tdist::test::Processes peer("channels_hostile_segment", 1,
                              {{"STORE", v.store}, {"ATTACK", attack}});
  v.negotiate(1);
  EXPECT_FALSE(v.uses_shm_with(0)) << attack;
  v.mesh->shutdown_all();
  auto r = peer.wait_all(60s);
  EXPECT_TRUE(r[0].ok()) << r[0].describe() << "\n" << r[0].output;
}

// The control: the hostile peer's honest offer is taken, so the refusals below are the checks'.
TEST(ChannelSecurity, AnHonestSegmentIsTaken) {
  Victim v;
  tdist::test::Processes peer("channels_hostile_segment", 1,
                              {{"STORE", v.store}, {"ATTACK", "none"}});
  v.negotiate(1);
  EXPECT_TRUE(v.uses_shm_with(0));
  v.mesh->shutdown_all();
  auto r = peer.wait_all(60s);
  EXPECT_TRUE(r[0].ok()) << r[0].describe() << "\n" << r[0].output;
}

TEST(ChannelSecurity, ASegmentOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a segment to another user";
  expect_refused("other_uid");
}

TEST(ChannelSecurity, ASegmentOthersMayWriteIsRefused) { expect_refused("open_mode"); }

TEST(ChannelSecurity, ARingLargerThanThisRankAgreedToIsRefused) { expect_refused("too_large"); }

TEST(ChannelSecurity, ASegmentLargerThanItsRingIsRefused) { expect_refused("wrong_size"); }

// A lower rank cannot hand on a link that another pair's ranks made (whose process the kernel
// would then name): the link must answer with the hello of this pair.
TEST(ChannelSecurity, ALinkThatAnswersForAnotherPairIsRefused) { expect_refused("other_pair"); }

// The victim, in a child process of its own (a SIGBUS must not end the test binary): rank 1 of
// the mesh; once told, it writes into its channel to rank 0. Exit 0: it survived.
TDIST_TEST_CHILD(channels_shrink_victim) {
  auto mesh = join_mesh(env::require("STORE"), 1);
  ChannelOptions o;
  o.host = kHost;
  Channels channels = make_channels(*mesh, 0, o, soon());
  uint8_t go = 0;
  mesh->get(0, 0)->read_all(&go, 1, soon(), "the go");  // sent on the connection itself
  const std::string data(4096, 'x');
  iovec iov{const_cast<char*>(data.data()), data.size()};
  channels.peers[0]->writev(&iov, 1);  // touches the segment when it is shared memory
  std::printf("survived\n");
  return 0;
}

TDIST_TEST_CHILD(channels_shrink_attacker) {
  ::setenv("ATTACK", "shrink", 1);
  return channels_hostile_segment_body(rank, world_size);
}

// A segment the creator shrinks after its peer mapped it must not crash the peer (SIGBUS). On
// 4622ec6 the segment was a named POSIX object that could not be sealed; now the peer maps only
// a sealed one, and this creator's unsealed segment is refused.
TEST(ChannelSecurity, ASegmentItsCreatorShrinksCannotCrashThePeer) {
  const std::string dir = tdist::test::temp_dir("tdist-channels");
  const std::string store = dir + "/store";
  tdist::test::Processes attacker("channels_shrink_attacker", 1, {{"STORE", store}});
  tdist::test::Processes victim("channels_shrink_victim", 1, {{"STORE", store}});
  auto v = victim.wait_all(60s);
  EXPECT_TRUE(v[0].ok()) << v[0].describe() << "\n" << v[0].output;
  attacker.wait_all(60s);
}

}  // namespace
}  // namespace tdist::comm
