#pragma once
// Whether the process on the other end of a TCP connection is a given local process whose
// memory we may read: the same-host fast path's decision (Note [RPC handshake] in rpc/detail/auth.h).
//
// Decided from facts the kernel gives, never from what the peer says about itself (its pid is
// only a hint, checked here):
//   1. the peer's end of this very connection is a socket in our own network namespace's TCP
//      table (/proc/net/tcp, tcp6: same host, same namespace), ESTABLISHED, created by our
//      effective uid;
//   2. process `pid` runs as our effective uid and holds that socket (a descriptor in
//      /proc/<pid>/fd that is socket:[its inode]);
//   3. the kernel lets us read `pid`'s memory at all (can_read_process in
//      core/process_memory.h: its ptrace policy).
// A peer on another host, in another network namespace or PID namespace, of another user, or
// one that names a process that does not hold its socket (e.g. ours) fails one of them.
// Thread safety: stateless; blocking only on /proc reads.

#include <sys/types.h>

#include <string>

namespace tdist::rpc::detail {

// True when all three checks pass; otherwise false, with the first failed check in `why`.
bool peer_is_local_process(int fd, pid_t pid, std::string* why);

}  // namespace tdist::rpc::detail
