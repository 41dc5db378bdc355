#pragma once
// Reading another local process's memory (process_vm_readv): one copy from the sender's memory
// straight into ours, for the same-host paths of RPC (large tensors) and of the collectives
// (Note [Single-copy collectives] in comm/algorithms/single_copy.h).
//
// The kernel lets us read a process when we may ptrace it: the same user and, under Yama's
// ptrace_scope 1, only a descendant, or a process that named us; containers often forbid it.
// A peer's pid is also only meaningful in our own PID namespace. So neither side assumes it
// works, and neither takes a peer's word for which process it is: the collectives learn the
// peer's pid from the kernel (SO_PEERCRED on the local link, comm/transport/shm/local_link.h),
// RPC checks the pid a peer names against the kernel's tables (rpc/detail/same_host.h), and
// both then probe with can_read_process(). No address of ours is ever sent to a peer to prove
// anything. Anyone who cannot use the path falls back to copying through sockets or shared
// memory. Nothing here writes into another process: a peer that is late (stopped, then
// resumed) could otherwise write into memory its owner had given up on and freed (Note
// [Single-copy collectives]).
//
// Thread safety: every function may be called from any thread.

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

namespace tdist {

// Reads `size` bytes of process `pid` at `address` into `out`. Throws NetworkError (naming
// the pid and the kernel's reason) when the kernel refuses or the range is not mapped.
void read_process_memory(pid_t pid, uint64_t address, void* out, size_t size);
// The same without throwing: 0 when every byte was read, else the errno that stopped it
// (ESRCH: no such process; EFAULT: not mapped or a short read; EPERM: not allowed).
int try_read_process_memory(pid_t pid, uint64_t address, void* out, size_t size) noexcept;

// Whether the kernel lets this process read process `pid`'s memory: reads one byte of its first
// readable mapping (/proc/<pid>/maps). Says nothing about who `pid` is: callers learn that
// from the kernel (SO_PEERCRED, /proc), never from the peer. Never throws.
bool can_read_process(pid_t pid);

}  // namespace tdist
