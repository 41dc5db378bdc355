// The TCP link tdist-bench measures its bound over (apps/bench/bounds.h; issue 41, item 12): its
// listener serves only a peer that presents its key, closing strangers and waiting on; the serving
// end refuses a batch larger than the benchmark measures before allocating anything (it resized
// its buffer to any size a peer sent: 1 TiB here).

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "apps/bench/bounds.h"
#include "tdist/core/error.h"
#include "tdist/core/net/address.h"
#include "tests/harness/expect.h"

namespace tdist::bench {
namespace {

// A raw connection to the listener that sends `bytes` and reports whether the listener closed it.
bool closed_after_sending(int port, const std::string& bytes) {
  const int fd = net::connect_to("127.0.0.1", static_cast<uint16_t>(port),
                                 net::Clock::now() + std::chrono::seconds(10), "the listener");
  if (!bytes.empty()) {
    EXPECT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL, 0) & ~O_NONBLOCK);  // connect_to's is non-blocking
  ::timeval wait{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof(wait));
  char c;
  const ssize_t n = ::recv(fd, &c, 1, 0);
  const bool reset = n < 0 && errno == ECONNRESET;  // closed with our extra bytes unread
  ::close(fd);
  return n == 0 || reset;
}

TEST(BenchBoundsLink, StrangersAreClosedAndThePeerWithTheKeyIsServed) {
  TcpListener listener("127.0.0.1");
  ASSERT_EQ(listener.key().size(), 32u);
  EXPECT_NE(TcpListener("127.0.0.1").key(), listener.key());  // each listener its own
  std::thread server([&] {
    TcpLink link = listener.accept();
    serve_tcp_bounds(link, 1 << 20);
  });
  std::string wrong = listener.key();
  wrong[0] = wrong[0] == 'a' ? 'b' : 'a';
  EXPECT_TRUE(closed_after_sending(listener.port(), wrong));
  EXPECT_TRUE(closed_after_sending(listener.port(), ""));  // says nothing: closed after a second
  EXPECT_TRUE(closed_after_sending(listener.port(), "GET / HTTP/1.0\r\n\r\n0123456789abcdef"));
  {
    TcpLink link = TcpLink::connect("127.0.0.1", listener.port(), listener.key());
    const auto times = time_tcp(link, TcpPattern::kPingPong, 1000, 1, 3);
    ASSERT_EQ(times.size(), 3u);
    for (double t : times) EXPECT_GT(t, 0);
  }  // closing the link ends serve_tcp_bounds
  server.join();
}

TEST(BenchBoundsLink, ABatchLargerThanTheBenchmarkMeasuresIsRefusedBeforeAllocating) {
  TcpListener listener("127.0.0.1");
  std::thread client([&] {
    TcpLink link = TcpLink::connect("127.0.0.1", listener.port(), listener.key());
    struct {
      uint64_t bytes;
      uint32_t pattern;
      uint32_t count;
    } header{uint64_t{1} << 40, 0, 1};  // time_tcp's batch header, asking for 1 TiB transfers
    link.send_all(&header, sizeof(header));
    char c;
    try {
      link.recv_all(&c, 1);  // until the server gives up on the link
    } catch (const std::runtime_error&) {}
  });
  try {
    TcpLink link = listener.accept();
    serve_tcp_bounds(link, 4096);
    ADD_FAILURE() << "served a batch of 1 TiB transfers";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(tdist::test::contains(e.what(), "1099511627776 bytes")) << e.what();
    EXPECT_TRUE(tdist::test::contains(e.what(), "at most 4096")) << e.what();
  }
  client.join();
}

}  // namespace
}  // namespace tdist::bench
