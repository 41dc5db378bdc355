#include "tdist/rpc/detail/auth.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/net/handshake.h"
#include "tdist/core/wire.h"
#include "tdist/rpc/detail/same_host.h"
#include "tdist/rpc/types.h"

namespace tdist::rpc::detail {
namespace {

constexpr size_t kHelloFields = 4 + 4 + 4;   // rank, pid, wants the fast path
constexpr size_t kAcceptFields = 4 + 4 + 4;  // pid, reads the client's tensors, offers
constexpr size_t kConfirmFields = 4;         // reads the server's tensors
constexpr uint8_t kBusy[4] = {'T', 'B', 'S', 'Y'};

// Reads the server's ACCEPT (Note [RPC handshake], busy): the busy marker or a reset is
// NetworkError (retried), a close before ACCEPT a refusal (ProtocolError, not retried).
void read_accept(int fd, Bytes& accept, net::Clock::time_point deadline, const std::string& who) {
  const std::string where = "handshake with " + who;
  size_t got = 0;
  while (got < accept.size()) {
    if (net::poll_one(fd, POLLIN, deadline) == 0) {
      throw TimeoutError(str(where, ": no answer to the hello in time"));
    }
    ssize_t n = ::recv(fd, accept.data() + got, accept.size() - got, MSG_DONTWAIT);
    if (n > 0) {
      got += static_cast<size_t>(n);
      if (got >= sizeof(kBusy) && std::memcmp(accept.data(), kBusy, sizeof(kBusy)) == 0) {
        throw NetworkError(str(where,
                               ": busy (more connections in their handshake than it "
                               "takes at once); retrying"));
      }
    } else if (n == 0) {
      throw ProtocolError(str(where, ": connection closed by the peer (", who,
                              " refused this connection: is the token the same on every "
                              "process?)"));
    } else if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK) {
      throw NetworkError(str(where, ": ", net::errno_text(errno)));
    }
  }
}

// The reading side's fast-path decision (Note [RPC handshake]): from its own checks only.
bool may_read_peer(bool fast_path, bool peer_wants, int fd, pid_t pid, const std::string& who) {
  if (!fast_path || !peer_wants) return false;
  std::string why;
  if (peer_is_local_process(fd, pid, &why)) return true;
  TDIST_LOG_DEBUG("rpc: no same-host fast path with ", who, ": ", why);
  return false;
}

}  // namespace

void send_busy(int fd) { ::send(fd, kBusy, sizeof(kBusy), MSG_NOSIGNAL | MSG_DONTWAIT); }

HandshakeResult server_handshake(int fd, const HandshakeOptions& o,
                                 const std::function<bool()>& after_hello) {
  const auto deadline = net::Clock::now() + o.timeout;
  net::ServerHandshake hs(o.token, net::Service::kRpc, o.issued);
  const std::string what = "handshake";
  net::write_all(fd, hs.challenge().data(), hs.challenge().size(), deadline,
                 what + ": sending the challenge");

  Bytes hello(net::hello_bytes(kHelloFields));
  net::read_exact(fd, hello.data(), hello.size(), deadline, what + ": reading the hello");
  const Bytes fields = hs.verify_hello(hello.data(), hello.size(), kHelloFields);
  if (after_hello && !after_hello()) {
    throw NetworkError("closed before its hello was read, to make room for other connections");
  }
  wire::Reader c(fields);
  HandshakeResult r;
  r.peer_rank = static_cast<int32_t>(c.u32());
  const auto claimed_pid = static_cast<pid_t>(c.u32());
  const bool client_wants = c.u32() == 1;
  if (r.peer_rank < 0 || r.peer_rank >= o.world_size) {
    throw ProtocolError(str("handshake: rank ", r.peer_rank, " is not in [0, ", o.world_size, ")"));
  }
  // Authenticated: from here on the peer may learn our pid, and we check its claim.
  r.read_remote_tensors =
      may_read_peer(o.fast_path, client_wants, fd, claimed_pid, str("worker rank ", r.peer_rank));
  if (r.read_remote_tensors) r.peer_pid = claimed_pid;

  Bytes ours;
  wire::Writer w(ours);
  w.u32(static_cast<uint32_t>(::getpid()));
  w.u32(r.read_remote_tensors ? 1 : 0);
  w.u32(o.fast_path ? 1 : 0);
  const Bytes accept = hs.accept(ours);
  net::write_all(fd, accept.data(), accept.size(), deadline, what + ": sending the acceptance");

  Bytes confirm(net::confirm_bytes(kConfirmFields));
  net::read_exact(fd, confirm.data(), confirm.size(), deadline,
                  what + ": reading the confirmation");
  const Bytes confirmed = hs.verify_confirm(confirm.data(), confirm.size(), kConfirmFields);
  wire::Reader k(confirmed);
  r.send_remote_tensors = o.fast_path && k.u32() == 1;
  return r;
}

HandshakeResult client_handshake(int fd, const HandshakeOptions& o, int expected_peer) {
  const auto deadline = net::Clock::now() + o.timeout;
  const auto who = str("worker rank ", expected_peer);
  Bytes ours;
  wire::Writer w(ours);
  w.u32(static_cast<uint32_t>(o.my_rank));
  w.u32(static_cast<uint32_t>(::getpid()));
  w.u32(o.fast_path ? 1 : 0);
  // A call to this worker itself connects to its own server: only then is its challenge ours.
  net::ClientHandshake hs(o.token, net::Service::kRpc,
                          expected_peer == o.my_rank ? nullptr : o.issued);
  uint8_t challenge[net::kChallengeBytes];
  net::read_exact(fd, challenge, sizeof(challenge), deadline, "handshake with " + who);
  Bytes hello;
  try {
    hello = hs.hello(challenge, sizeof(challenge), ours);
  } catch (const ProtocolError& e) {
    throw ProtocolError(str("handshake with ", who, ": ", e.what()));
  }
  net::write_all(fd, hello.data(), hello.size(), deadline, "handshake with " + who);
  Bytes theirs(net::accept_bytes(kAcceptFields));
  read_accept(fd, theirs, deadline, who);
  try {
    theirs = hs.verify_accept(theirs.data(), theirs.size(), kAcceptFields);
  } catch (const ProtocolError& e) {
    throw ProtocolError(str("handshake with ", who, ": ", e.what()));
  }
  wire::Reader a(theirs);
  HandshakeResult r;
  r.peer_rank = expected_peer;
  const auto claimed_pid = static_cast<pid_t>(a.u32());
  const bool server_reads_us = a.u32() == 1;
  const bool server_wants = a.u32() == 1;
  r.send_remote_tensors = o.fast_path && server_reads_us;
  r.read_remote_tensors =
      may_read_peer(o.fast_path, server_wants, fd, claimed_pid, "handshake with " + who);
  if (r.read_remote_tensors) r.peer_pid = claimed_pid;

  Bytes confirm_fields;
  wire::Writer k(confirm_fields);
  k.u32(r.read_remote_tensors ? 1 : 0);
  const Bytes confirm = hs.confirm(confirm_fields);
  net::write_all(fd, confirm.data(), confirm.size(), deadline, "handshake with " + who);
  return r;
}

}  // namespace tdist::rpc::detail
