#include "tdist/comm/transport/shm/local_link.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "tdist/core/error.h"
#include "tdist/core/token.h"

namespace tdist::comm::shm {
namespace {

// Connections a listener looks at per accept_hello(): the honest one is among the first few
// (the backlog is small), and a stranger who keeps connecting cannot keep us looping.
constexpr int kBacklog = 16;
constexpr int kMaxAccepts = 64;

std::string errno_why(const char* what) { return str(what, ": ", std::strerror(errno)); }

sockaddr_un abstract_address(const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  // sun_path[0] stays NUL: the abstract namespace. The name is not NUL-terminated.
  std::memcpy(a.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}

std::string random_name() { return str("tdist-link-", ::getpid(), "-", random_hex(16)); }

}  // namespace

bool peer_credentials(int fd, PeerCredentials* out, std::string* why) {
  struct ucred cred {};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof(cred)) {
    *why = errno_why("SO_PEERCRED");
    return false;
  }
  out->pid = cred.pid;
  out->uid = cred.uid;
  return true;
}

std::unique_ptr<LinkListener> LinkListener::open(std::string* why) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    *why = errno_why("socket(AF_UNIX)");
    return nullptr;
  }
  const std::string name = random_name();
  socklen_t len = 0;
  const sockaddr_un a = abstract_address(name, &len);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&a), len) != 0 || ::listen(fd, kBacklog) != 0) {
    *why = errno_why("binding the local link");
    ::close(fd);
    return nullptr;
  }
  return std::unique_ptr<LinkListener>(new LinkListener(fd, name));
}

LinkListener::~LinkListener() { ::close(fd_); }

int LinkListener::accept_hello(const Bytes& hello, std::string* why) {
  *why = "no connection brought the expected hello";
  for (int i = 0; i < kMaxAccepts; ++i) {
    const int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c < 0) {
      if (errno == EINTR) continue;
      return -1;  // EAGAIN: none left
    }
    // One byte more than the hello: a connection that sent more is not the honest peer.
    Bytes got(hello.size() + 1);
    const ssize_t n = ::recv(c, got.data(), got.size(), MSG_DONTWAIT);
    if (n == static_cast<ssize_t>(hello.size()) &&
        std::memcmp(got.data(), hello.data(), hello.size()) == 0) {
      return c;
    }
    ::close(c);
  }
  *why = str("more than ", kMaxAccepts, " connections to the local link");
  return -1;
}

int connect_link(const std::string& name, const Bytes& hello, std::string* why) {
  if (name.empty() || name.size() > sizeof(sockaddr_un::sun_path) - 1) {
    *why = str("a local link name of ", name.size(), " bytes");
    return -1;
  }
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    *why = errno_why("socket(AF_UNIX)");
    return -1;
  }
  socklen_t len = 0;
  const sockaddr_un a = abstract_address(name, &len);
  // A Unix stream connect completes at once or fails (EAGAIN: the backlog is full).
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), len) != 0) {
    *why = errno_why("connecting to the local link");
    ::close(fd);
    return -1;
  }
  if (::send(fd, hello.data(), hello.size(), MSG_DONTWAIT | MSG_NOSIGNAL) !=
      static_cast<ssize_t>(hello.size())) {
    *why = errno_why("sending the local link's hello");
    ::close(fd);
    return -1;
  }
  return fd;
}

namespace {

// Room for one descriptor beside a message's bytes (SCM_RIGHTS).
struct OneFdControl {
  alignas(cmsghdr) char bytes[CMSG_SPACE(sizeof(int))] = {};
};

// A message of the bytes `iov` names, with `control` for one descriptor.
msghdr one_fd_message(iovec* iov, OneFdControl* control) {
  msghdr m{};
  m.msg_iov = iov;
  m.msg_iovlen = 1;
  m.msg_control = control->bytes;
  m.msg_controllen = sizeof(control->bytes);
  return m;
}

}  // namespace

bool send_with_fd(int sock, const Bytes& data, int fd, std::string* why) {
  iovec iov{const_cast<uint8_t*>(data.data()), data.size()};
  OneFdControl control;
  msghdr m = one_fd_message(&iov, &control);
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  if (::sendmsg(sock, &m, MSG_DONTWAIT | MSG_NOSIGNAL) != static_cast<ssize_t>(data.size())) {
    *why = errno_why("sending the segment");
    return false;
  }
  return true;
}

int receive_with_fd(int sock, void* data, size_t size, std::string* why) {
  Bytes got(size + 1);  // one byte more: more than `size` is refused
  iovec iov{got.data(), got.size()};
  OneFdControl control;
  msghdr m = one_fd_message(&iov, &control);
  ssize_t n;
  do {
    n = ::recvmsg(sock, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    *why = errno_why("receiving the segment");
    return -1;
  }
  int fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS &&
        c->cmsg_len == CMSG_LEN(sizeof(int)) && fd < 0) {
      std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
    }
  }
  // MSG_CTRUNC: the peer attached more descriptors than one (the kernel closed the rest).
  if (n != static_cast<ssize_t>(size) || fd < 0 || (m.msg_flags & MSG_CTRUNC) != 0) {
    if (fd >= 0) ::close(fd);
    *why = str("the local link brought ", n, " bytes (", size, " expected) and ",
               fd < 0 ? "no descriptor" : "a descriptor",
               (m.msg_flags & MSG_CTRUNC) != 0 ? " (and more, cut off)" : "");
    return -1;
  }
  std::memcpy(data, got.data(), size);
  return fd;
}

}  // namespace tdist::comm::shm
