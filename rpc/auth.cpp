#include "tdist/rpc/auth.h"

#include <unistd.h>

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

// The reading side's fast-path decision (Note [RPC handshake]): from its own checks only.
bool may_read_peer(bool fast_path, bool peer_wants, int fd, pid_t pid, const std::string& who) {
  if (!fast_path || !peer_wants) return false;
  std::string why;
  if (peer_is_local_process(fd, pid, &why)) return true;
  TDIST_LOG_DEBUG("rpc: no same-host fast path with ", who, ": ", why);
  return false;
}

}  // namespace

HandshakeResult server_handshake(int fd, const HandshakeOptions& o) {
  const auto deadline = net::Clock::now() + o.timeout;
  net::ServerHandshake hs(o.token, net::Service::kRpc, o.issued);
  const std::string what = "handshake";
  net::write_all(fd, hs.challenge().data(), hs.challenge().size(), deadline,
                 what + ": sending the challenge");

  Bytes hello(net::hello_bytes(kHelloFields));
  net::read_exact(fd, hello.data(), hello.size(), deadline, what + ": reading the hello");
  const Bytes fields = hs.verify_hello(hello.data(), hello.size(), kHelloFields);
  wire::Reader c(fields);
  HandshakeResult r;
  r.peer_rank = static_cast<int32_t>(c.u32());
  const auto claimed_pid = static_cast<pid_t>(c.u32());
  const bool client_wants = c.u32() == 1;
  if (r.peer_rank < 0 || r.peer_rank >= o.world_size) {
    throw ProtocolError(str("handshake: rank ", r.peer_rank, " is not in [0, ", o.world_size, ")"));
  }
  // Authenticated: from here on the peer may learn our pid, and we check its claim.
  r.read_remote_tensors = may_read_peer(o.fast_path, client_wants, fd, claimed_pid,
                                        str("worker rank ", r.peer_rank));
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
  const Bytes theirs = net::client_handshake(fd, hs, ours, kAcceptFields, deadline, who);
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
