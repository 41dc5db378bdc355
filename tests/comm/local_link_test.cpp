// The local link (comm/transport/shm/local_link.h): a listener takes only the connection that
// brought exactly the expected hello and never waits for one; the kernel, not the peer, names
// the process at each end; a descriptor arrives only with exactly the expected bytes.

#include <gtest/gtest.h>

#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "tdist/comm/transport/shm/local_link.h"

namespace tdist::comm::shm {
namespace {

const Bytes kHello = to_bytes("the hello of one pair, 48 bytes long, or so....");

std::unique_ptr<LinkListener> listen_or_skip() {
  std::string why;
  auto l = LinkListener::open(&why);
  EXPECT_TRUE(l) << why;
  return l;
}

TEST(LocalLink, TheConnectionWithTheHelloIsTakenStrangersAreClosed) {
  auto l = listen_or_skip();
  ASSERT_TRUE(l);
  std::string why;
  const int silent = connect_link(l->name(), Bytes{}, &why);  // says nothing
  const int wrong = connect_link(l->name(), to_bytes("not the hello"), &why);
  Bytes longer = kHello;
  longer.push_back('!');
  const int more = connect_link(l->name(), longer, &why);  // the hello and a byte more
  const int honest = connect_link(l->name(), kHello, &why);
  ASSERT_GE(silent, 0) << why;
  ASSERT_GE(wrong, 0) << why;
  ASSERT_GE(more, 0) << why;
  ASSERT_GE(honest, 0) << why;
  const int taken = l->accept_hello(kHello, &why);
  ASSERT_GE(taken, 0) << why;
  // The strangers before it were closed: their next read sees the end.
  for (int fd : {silent, wrong, more}) {
    char b;
    EXPECT_EQ(::recv(fd, &b, 1, 0), 0);
    ::close(fd);
  }
  // The kernel names this process at both ends (a link within one process).
  PeerCredentials a, b;
  ASSERT_TRUE(peer_credentials(taken, &a, &why)) << why;
  ASSERT_TRUE(peer_credentials(honest, &b, &why)) << why;
  EXPECT_EQ(a.pid, ::getpid());
  EXPECT_EQ(b.pid, ::getpid());
  EXPECT_EQ(a.uid, ::geteuid());
  // Nothing more is queued: it returns at once.
  EXPECT_EQ(l->accept_hello(kHello, &why), -1);
  ::close(taken);
  ::close(honest);
}

TEST(LocalLink, NoListenerNoLink) {
  std::string why;
  EXPECT_EQ(connect_link("tdist-link-nobody-listens-here", kHello, &why), -1);
  EXPECT_FALSE(why.empty());
  EXPECT_EQ(connect_link("", kHello, &why), -1);
  EXPECT_EQ(connect_link(std::string(200, 'x'), kHello, &why), -1);
}

TEST(LocalLink, ADescriptorComesOnlyWithExactlyTheExpectedBytes) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  const int memfd = ::memfd_create("tdist-link-test", MFD_CLOEXEC);
  ASSERT_GE(memfd, 0);
  std::string why;
  Bytes got(kHello.size());
  // Bytes without a descriptor.
  ASSERT_EQ(::send(sv[0], kHello.data(), kHello.size(), 0), static_cast<ssize_t>(kHello.size()));
  EXPECT_EQ(receive_with_fd(sv[1], got.data(), got.size(), &why), -1);
  EXPECT_NE(why.find("no descriptor"), std::string::npos) << why;
  // Fewer bytes than expected, with a descriptor.
  ASSERT_TRUE(send_with_fd(sv[0], to_bytes("short"), memfd, &why)) << why;
  EXPECT_EQ(receive_with_fd(sv[1], got.data(), got.size(), &why), -1);
  // Nothing at all: no wait.
  EXPECT_EQ(receive_with_fd(sv[1], got.data(), got.size(), &why), -1);
  // The real thing.
  ASSERT_TRUE(send_with_fd(sv[0], kHello, memfd, &why)) << why;
  const int fd = receive_with_fd(sv[1], got.data(), got.size(), &why);
  ASSERT_GE(fd, 0) << why;
  EXPECT_EQ(got, kHello);
  ::close(fd);
  ::close(memfd);
  ::close(sv[0]);
  ::close(sv[1]);
}

}  // namespace
}  // namespace tdist::comm::shm
