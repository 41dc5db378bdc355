#pragma once
// The local link: a Unix-domain stream socket between the two ranks of a same-host pair, used
// once, during the shared-memory negotiation (Note [Shared-memory negotiation] in
// comm/transport/channels.h), for what their TCP connection cannot carry: the kernel's word on
// which process is at the other end (SO_PEERCRED) and the segment itself (its descriptor, passed
// with SCM_RIGHTS, so that no segment ever has a name another process could open or replace).
//
// The lower rank listens on a fresh random name in the abstract namespace (one per network
// namespace, like the host key; nothing on disk; gone with the socket) and the higher rank
// connects. Anyone on the host may see that name (/proc/net/unix) and connect, so the listener
// takes only a connection whose first bytes are the hello it expects (it carries a random nonce
// that travelled over the pair's authenticated TCP connection), and it never waits for one: the
// honest peer connects and writes its hello before it answers on TCP, so once the lower rank has
// read that answer the connection and its hello are queued already. A stranger who connects
// first, says nothing or fills the backlog makes the pair use TCP; it holds up no one.
//
// Thread safety: none; each object belongs to one negotiation on one thread. Nothing blocks.

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "tdist/core/store.h"

namespace tdist::comm::shm {

// The kernel's account of the process at the other end of a connected Unix socket: for the
// connecting side, the process that called listen(); for the accepting side, the one that
// called connect(). pid 0: that process is not visible in our PID namespace.
struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = static_cast<uid_t>(-1);
};
// False (and `why`) when the kernel does not say.
bool peer_credentials(int fd, PeerCredentials* out, std::string* why);

class LinkListener {
 public:
  // Listens on a fresh random abstract name; nullptr when that fails (`why` says why).
  static std::unique_ptr<LinkListener> open(std::string* why);
  ~LinkListener();
  LinkListener(const LinkListener&) = delete;
  LinkListener& operator=(const LinkListener&) = delete;

  // The abstract name (without its leading NUL), at most 107 bytes.
  const std::string& name() const { return name_; }
  // Accepts the queued connections and returns the first whose first bytes, already received,
  // are exactly `hello` (the caller closes it); -1 when there is none (`why`). Closes the others.
  int accept_hello(const Bytes& hello, std::string* why);

 private:
  LinkListener(int fd, std::string name) : fd_(fd), name_(std::move(name)) {}
  const int fd_;
  const std::string name_;
};

// Connects to the abstract `name` and writes `hello`: the socket (the caller closes it), or -1
// when either fails at once (`why`).
int connect_link(const std::string& name, const Bytes& hello, std::string* why);

// Sends `data` with descriptor `fd` attached (SCM_RIGHTS). False on failure (`why`).
bool send_with_fd(int sock, const Bytes& data, int fd, std::string* why);
// Receives, without waiting, exactly `size` bytes sent with one descriptor: the descriptor (the
// caller closes it), or -1 when less, more or nothing came, or no descriptor (`why`).
int receive_with_fd(int sock, void* data, size_t size, std::string* why);

}  // namespace tdist::comm::shm
