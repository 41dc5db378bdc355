// The shared-memory rings trust nothing in the segment (Note [Shared-memory rings]): the peer can
// write every byte of it, so an impossible head or tail it publishes fails the channel with
// EPROTO instead of handing out spans outside the ring, and rewriting our own counters in the
// segment changes nothing we read or write. A side that sleeps on its futex bell (wait_alone) is
// woken by the peer's bytes through the bell, not the socket, and by a dead peer or a shutdown.
// Exchange::skip drops a stream's bytes unread (through the ring in place, or a socket) and keeps
// everything after them in order.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tdist/comm/engine/exchange.h"
#include "tdist/comm/transport/shm/shm_channel.h"
#include "tdist/comm/transport/tcp/connection.h"
#include "tdist/comm/transport/tcp/tcp_channel.h"
#include "tdist/core/error.h"

namespace tdist::comm::shm {
namespace {

constexpr size_t kCapacity = kMinCapacity;

// Both ends of a connected socket pair, as ranks 0 and 1 hold them (each names the other as its
// peer); false when the pair cannot be made.
bool connect_pair(std::unique_ptr<tcp::Connection>& rank0,
                  std::unique_ptr<tcp::Connection>& rank1) {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds) != 0) return false;
  rank0 = std::make_unique<tcp::Connection>(fds[0], 1);
  rank1 = std::make_unique<tcp::Connection>(fds[1], 0);
  return true;
}

// Two channels over one segment, as the two ranks of a pair hold them, and the segment's ring
// headers as a hostile peer would see them.
struct Pair {
  std::unique_ptr<tcp::Connection> lower_conn, upper_conn;
  std::unique_ptr<ShmChannel> lower, upper;
  RingHeader* headers = nullptr;  // [0]: lower -> upper, [1]: upper -> lower

  Pair() {
    auto created = Segment::create(segment_bytes(kCapacity));
    if (!created) return;
    std::string why;
    auto opened = Segment::map_peer(created->fd(), segment_bytes(kCapacity), &why);
    created->close_fd();
    if (!opened) return;
    headers = reinterpret_cast<RingHeader*>(opened->data());
    if (!connect_pair(lower_conn, upper_conn)) return;
    lower = std::make_unique<ShmChannel>(std::move(created), kCapacity, true, lower_conn.get());
    upper = std::make_unique<ShmChannel>(std::move(opened), kCapacity, false, upper_conn.get());
  }
  bool ok() const { return lower && upper; }
};

// A peer's segment is mapped only when it is what Segment::create makes: a regular file of our
// uid that no one else may open, exactly the agreed size, sealed against resizing.
TEST(ShmSegment, OnlyASealedPrivateSegmentOfTheAgreedSizeIsMapped) {
  const size_t bytes = segment_bytes(kCapacity);
  auto good = Segment::create(bytes);
  if (!good) GTEST_SKIP() << "no shared memory here";
  std::string why;
  EXPECT_TRUE(Segment::map_peer(good->fd(), bytes, &why)) << why;
  EXPECT_FALSE(Segment::map_peer(good->fd(), bytes - 4096, &why));  // not the agreed size
  EXPECT_NE(why.find("not the"), std::string::npos) << why;
  EXPECT_EQ(::ftruncate(good->fd(), 0), -1);  // sealed: its creator cannot shrink it
  auto made = [&](int mode, bool seal) {
    const int fd = ::memfd_create("tdist-segment-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(bytes)), 0);
    EXPECT_EQ(::fchmod(fd, mode), 0);
    if (seal) {
      EXPECT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), 0);
    }
    return fd;
  };
  int fd = made(0600, false);
  EXPECT_FALSE(Segment::map_peer(fd, bytes, &why));
  EXPECT_NE(why.find("not sealed"), std::string::npos) << why;
  ::close(fd);
  fd = made(0666, true);
  EXPECT_FALSE(Segment::map_peer(fd, bytes, &why));
  EXPECT_NE(why.find("mode"), std::string::npos) << why;
  ::close(fd);
  if (::geteuid() == 0) {
    fd = made(0600, true);
    ASSERT_EQ(::fchown(fd, 65534, 65534), 0);
    EXPECT_FALSE(Segment::map_peer(fd, bytes, &why));
    EXPECT_NE(why.find("uid"), std::string::npos) << why;
    ::close(fd);
  }
  fd = made(0600, true);
  EXPECT_TRUE(Segment::map_peer(fd, bytes, &why)) << why;
  ::close(fd);
}

long write_bytes(Channel& ch, const std::string& s) {
  iovec iov{const_cast<char*>(s.data()), s.size()};
  return ch.writev(&iov, 1);
}

std::string read_bytes(Channel& ch, size_t n) {
  std::string out(n, '\0');
  iovec iov{out.data(), n};
  long got = ch.readv(&iov, 1);
  out.resize(got > 0 ? static_cast<size_t>(got) : 0);
  return out;
}

TEST(ShmRing, BytesCrossInOrderAndPeekShowsThem) {
  Pair p;
  if (!p.ok()) GTEST_SKIP() << "no shared memory here";
  ASSERT_EQ(write_bytes(*p.lower, "hello"), 5);
  iovec spans[2];
  ASSERT_EQ(p.upper->peek(spans), 5);
  EXPECT_EQ(std::string(static_cast<char*>(spans[0].iov_base), spans[0].iov_len), "hello");
  p.upper->consume(2);
  EXPECT_EQ(read_bytes(*p.upper, 16), "llo");
  EXPECT_EQ(read_bytes(*p.upper, 16), "");
}

TEST(ShmRing, HeadBeyondTheRingFailsPeekAndReadWithEproto) {
  Pair p;
  if (!p.ok()) GTEST_SKIP() << "no shared memory here";
  ASSERT_EQ(write_bytes(*p.lower, "abc"), 3);
  // The "sender" claims more unread bytes than the ring holds: a span past the mapping.
  p.headers[0].head.store(kCapacity + 100);
  iovec spans[2];
  errno = 0;
  EXPECT_EQ(p.upper->peek(spans), Channel::kError);
  EXPECT_EQ(errno, EPROTO);
  errno = 0;
  char buf[8];
  iovec iov{buf, sizeof(buf)};
  EXPECT_EQ(p.upper->readv(&iov, 1), Channel::kError);
  EXPECT_EQ(errno, EPROTO);
  // It stays failed even if the peer puts the counter back.
  p.headers[0].head.store(3);
  EXPECT_EQ(p.upper->readv(&iov, 1), Channel::kError);
}

TEST(ShmRing, HeadBehindOurTailFailsWithEproto) {
  Pair p;
  if (!p.ok()) GTEST_SKIP() << "no shared memory here";
  ASSERT_EQ(write_bytes(*p.lower, "abcdef"), 6);
  ASSERT_EQ(read_bytes(*p.upper, 6), "abcdef");
  p.headers[0].head.store(2);  // moves backwards: 2 - 6 wraps to almost 2^64 readable bytes
  iovec spans[2];
  errno = 0;
  EXPECT_EQ(p.upper->peek(spans), Channel::kError);
  EXPECT_EQ(errno, EPROTO);
}

TEST(ShmRing, TailAheadOfOurHeadFailsWritesWithEproto) {
  Pair p;
  if (!p.ok()) GTEST_SKIP() << "no shared memory here";
  ASSERT_EQ(write_bytes(*p.lower, "abc"), 3);
  // The "receiver" claims to have consumed bytes never written: more space than the ring has.
  p.headers[0].tail.store(1000);
  // A write that fits the space the sender last saw does not read the tail (Note [Shared-memory
  // rings]); the first one that needs more reads it and fails.
  ASSERT_EQ(write_bytes(*p.lower, "more"), 4);
  errno = 0;
  EXPECT_EQ(write_bytes(*p.lower, std::string(kCapacity - 6, 'x')), Channel::kError);
  EXPECT_EQ(errno, EPROTO);
  EXPECT_EQ(write_bytes(*p.lower, "y"), Channel::kError);  // and stays failed
}

TEST(ShmRing, RewrittenOwnCountersInTheSegmentChangeNothing) {
  Pair p;
  if (!p.ok()) GTEST_SKIP() << "no shared memory here";
  ASSERT_EQ(write_bytes(*p.lower, "first"), 5);
  ASSERT_EQ(read_bytes(*p.upper, 5), "first");
  // The segment's tail of this ring goes back to 0 (as if the receiver had read nothing): the
  // receiver keeps its own tail, so the next message arrives once, without the first again.
  p.headers[0].tail.store(0);
  ASSERT_EQ(write_bytes(*p.lower, "second"), 6);
  EXPECT_EQ(read_bytes(*p.upper, 64), "second");
  EXPECT_EQ(read_bytes(*p.upper, 64), "");
  // The ring still fills to exactly its capacity and no further.
  std::string big(kCapacity, 'x');
  EXPECT_EQ(write_bytes(*p.lower, big), static_cast<long>(kCapacity));
  EXPECT_EQ(write_bytes(*p.lower, "y"), 0);
}

using std::chrono::steady_clock;
constexpr auto kLong = std::chrono::seconds(30);

// Bytes waiting on a socket, without taking them.
bool socket_holds_bytes(const tcp::Connection& c) {
  char b;
  return ::recv(c.fd(), &b, 1, MSG_PEEK | MSG_DONTWAIT) == 1;
}

// Starts upper->wait_alone(read) on another thread and returns once its flag is up.
std::future<bool> sleep_reading(Pair& p, steady_clock::time_point deadline) {
  auto f = std::async(std::launch::async,
                      [&p, deadline] { return p.upper->wait_alone(true, false, deadline); });
  while (p.headers[0].reader_waiting.load() == 0) std::this_thread::yield();
  return f;
}

TEST(ShmRing, ASleeperIsWokenThroughItsBellNotTheSocket) {
  Pair p;
  if (!p.ok()) GTEST_SKIP() << "no shared memory here";
  auto woke = sleep_reading(p, steady_clock::now() + kLong);
  EXPECT_EQ(p.headers[0].reader_waiting.load(), kWakeByBell);
  const uint32_t bell = p.headers[0].bell.load();
  ASSERT_EQ(write_bytes(*p.lower, "ding"), 4);
  EXPECT_TRUE(woke.get());
  EXPECT_NE(p.headers[0].bell.load(), bell);
  EXPECT_FALSE(socket_holds_bytes(*p.upper_conn)) << "the writer rang the socket";
  EXPECT_EQ(p.headers[0].reader_waiting.load(), 0u);
  EXPECT_EQ(read_bytes(*p.upper, 16), "ding");
}

TEST(ShmRing, ASleepingWriterIsWokenWhenSpaceFrees) {
  Pair p;
  if (!p.ok()) GTEST_SKIP() << "no shared memory here";
  ASSERT_EQ(write_bytes(*p.lower, std::string(kCapacity, 'x')), static_cast<long>(kCapacity));
  auto woke = std::async(std::launch::async, [&] {
    return p.lower->wait_alone(false, true, steady_clock::now() + kLong);
  });
  while (p.headers[0].writer_waiting.load() == 0) std::this_thread::yield();
  EXPECT_EQ(read_bytes(*p.upper, 100).size(), 100u);
  EXPECT_TRUE(woke.get());
  EXPECT_FALSE(socket_holds_bytes(*p.lower_conn));
  EXPECT_EQ(write_bytes(*p.lower, std::string(200, 'y')), 100);
}

TEST(ShmRing, DataAlreadyThereMeansNoSleep) {
  Pair p;
  if (!p.ok()) GTEST_SKIP() << "no shared memory here";
  ASSERT_EQ(write_bytes(*p.lower, "x"), 1);
  // A deadline in the past: only a wait that never sleeps can say "ready".
  EXPECT_TRUE(p.upper->wait_alone(true, false, steady_clock::now() - std::chrono::seconds(1)));
  EXPECT_EQ(p.headers[0].reader_waiting.load(), 0u);
}

TEST(ShmRing, ASleeperTimesOutAtItsDeadline) {
  Pair p;
  if (!p.ok()) GTEST_SKIP() << "no shared memory here";
  const auto deadline = steady_clock::now() + std::chrono::milliseconds(50);
  EXPECT_FALSE(p.upper->wait_alone(true, false, deadline));
  EXPECT_GE(steady_clock::now(), deadline);
  EXPECT_EQ(p.headers[0].reader_waiting.load(), 0u);
}

TEST(ShmRing, ASleeperNoticesThePeerIsGone) {
  Pair p;
  if (!p.ok()) GTEST_SKIP() << "no shared memory here";
  auto woke = sleep_reading(p, steady_clock::now() + kLong);
  p.lower_conn->shutdown();  // what a dead peer's kernel does to the socket; its bell stays silent
  EXPECT_TRUE(woke.get());
  char buf[8];
  iovec iov{buf, sizeof(buf)};
  EXPECT_EQ(p.upper->readv(&iov, 1), Channel::kClosed);
}

TEST(ShmRing, ShutdownWakesItsOwnSleeper) {
  Pair p;
  if (!p.ok()) GTEST_SKIP() << "no shared memory here";
  auto woke = sleep_reading(p, steady_clock::now() + kLong);
  p.upper->shutdown();  // an abort, from another thread
  EXPECT_EQ(woke.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_TRUE(woke.get());
}

// Two Exchanges over one pair of channels, as ranks 0 and 1 hold them: shared memory (the Pair
// above) or a TCP stream (TcpChannel over a socket pair).
struct ExchangePair {
  Pair shm;
  std::unique_ptr<tcp::Connection> conn0, conn1;
  std::unique_ptr<tcp::TcpChannel> tcp0, tcp1;
  Channel* ch0 = nullptr;  // rank 0's end
  Channel* ch1 = nullptr;
  std::atomic<bool> aborted{false};

  explicit ExchangePair(bool over_shm) {
    if (over_shm) {
      ch0 = shm.lower.get();
      ch1 = shm.upper.get();
      return;
    }
    if (!connect_pair(conn0, conn1)) return;
    tcp0 = std::make_unique<tcp::TcpChannel>(conn0.get());
    tcp1 = std::make_unique<tcp::TcpChannel>(conn1.get());
    ch0 = tcp0.get();
    ch1 = tcp1.get();
  }
  bool ok() const { return ch0 != nullptr && ch1 != nullptr; }
};

class ExchangeSkip : public ::testing::TestWithParam<bool> {};

// Three bytes read, then more than three rings' worth skipped (the ring wraps under it, and a
// socket's skip takes many reads), then ten bytes read: the reads hold exactly their bytes, the
// callbacks come in stream order, and every byte is counted.
TEST_P(ExchangeSkip, DropsBytesUnreadAndKeepsTheStreamInOrder) {
  ExchangePair p(GetParam());
  if (!p.ok()) GTEST_SKIP() << "no shared memory here";
  const size_t skipped = 3 * kCapacity + 5;
  std::string stream = "abc" + std::string(skipped, 'x') + "0123456789";
  for (size_t i = 0; i < skipped; ++i) stream[3 + i] = static_cast<char>('a' + i % 26);
  const auto deadline = steady_clock::now() + kLong;
  detail::Exchange sender({nullptr, p.ch0}, 0, &p.aborted);
  detail::Exchange receiver({p.ch1, nullptr}, 1, &p.aborted);
  sender.begin("test", 1, steady_clock::now(), deadline);
  receiver.begin("test", 1, steady_clock::now(), deadline);
  auto sent = std::async(std::launch::async, [&] {
    sender.send(1, stream.data(), stream.size());
    sender.run();
  });
  char first[3], last[10];
  receiver.recv(0, first, sizeof(first), 1);
  receiver.skip(0, skipped, 2);
  receiver.recv(0, last, sizeof(last), 3);
  std::vector<uint64_t> cookies;
  receiver.run([&](int peer, uint64_t cookie) {
    EXPECT_EQ(peer, 0);
    cookies.push_back(cookie);
  });
  sent.get();
  EXPECT_EQ(std::string(first, 3), "abc");
  EXPECT_EQ(std::string(last, 10), "0123456789");
  EXPECT_EQ(cookies, (std::vector<uint64_t>{1, 2, 3}));
  EXPECT_EQ(receiver.counts().bytes_received, stream.size());
  if (GetParam()) {
    EXPECT_EQ(p.shm.headers[0].tail.load(), stream.size());  // all consumed
  }
}

// A peer that goes away in the middle of a skip fails it with the lost rank and the bytes that
// did arrive, not a hang.
TEST_P(ExchangeSkip, APeerLostInTheMiddleFailsTheSkip) {
  ExchangePair p(GetParam());
  if (!p.ok()) GTEST_SKIP() << "no shared memory here";
  const std::string some(10, 's');
  iovec iov{const_cast<char*>(some.data()), some.size()};
  ASSERT_EQ(p.ch0->writev(&iov, 1), 10);
  (GetParam() ? *p.shm.lower_conn : *p.conn0).shutdown();  // rank 0 is gone
  detail::Exchange receiver({p.ch1, nullptr}, 1, &p.aborted);
  receiver.begin("test", 1, steady_clock::now(), steady_clock::now() + kLong);
  receiver.skip(0, 100);
  try {
    receiver.run();
    FAIL() << "the skip completed without its bytes";
  } catch (const NetworkError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("lost rank 0 while receiving from it"), std::string::npos) << what;
    EXPECT_NE(what.find("received 10 of the 100 bytes"), std::string::npos) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Channels, ExchangeSkip, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Shm" : "Tcp"; });

}  // namespace
}  // namespace tdist::comm::shm
