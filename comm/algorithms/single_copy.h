#pragma once
// Single-copy broadcast and allgather between processes of one host.
#include <cstddef>
#include <vector>

#include "tdist/comm/algorithms/context.h"

namespace tdist::comm::algorithms {

// Note [Single-copy collectives]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Through a shared-memory ring every byte is copied twice: by the sender into the ring and by
// the receiver out of it. When all of a group's ranks are distinct processes of one host that
// may read each other's memory (at set-up the kernel names each peer's process, never the peer
// itself, and ranks that are threads of one process are never read: Note [Shared-memory
// negotiation] in transport/channels.h, core/process_memory.h), a large allgather or broadcast
// copies
// each byte once instead: every rank tells the ranks that need its data where that data is
// (an 8-byte address over the collective channel), each of them copies it straight into its
// own output with process_vm_readv, and each then tells the owner it is done (one byte), so no
// rank returns (and lets its caller reuse the buffer) while a peer may still be reading it.
// The world-2 broadcast splits the copy: the root writes half into its peer (process_vm_writev,
// which the kernel allows exactly when it allows reading) while the peer reads the other half.
// The address message carries the size too: ranks that called the operation with different
// sizes all fail it (MismatchError; the group stays usable) before any memory is touched, so no
// rank ever writes past the end of a peer's buffer or reads past the end of a peer's data.
// No rank waits for another between the address and the done message: a rank whose peers are
// descheduled (four ranks on two cores) still copies at once, and the copies of all ranks run
// in parallel. Open MPI's shared-memory transport does the same (CMA).
// The group uses it when every rank allows it (TDIST_SINGLE_COPY, default on) and can read
// every peer: allgathers from world 3 with blocks of at least TDIST_SINGLE_COPY_BYTES (default
// 256 KiB) and world-2 broadcasts of at least as many bytes (RingProcessGroup::broadcast_bytes
// says why those). At set-up every rank sends every peer its threshold (the largest value, when
// disabled or a peer is unreadable) and the group takes the largest, so ranks with different
// settings still agree. A peer that dies mid-copy makes the read fail (ESRCH), an error that
// names the rank; a peer that stops is noticed at the done message's deadline.

// Broadcast by single copy between two ranks: the root writes the first half of `data` into
// the other rank's, which reads the second half (both cores copy at once). With `staging` as for
// broadcast_pipelined (the root's address leaves once its data arrived).
void broadcast_single_copy(Context& c, char* data, size_t bytes, int root,
                           Staging* staging = nullptr);
// Allgather by single copy: every rank reads blocks[i] from rank i's blocks[i]. With `staging`
// as for allgather_ring.
void allgather_single_copy(Context& c, const std::vector<char*>& blocks, size_t block_bytes,
                           Staging* staging = nullptr);

}  // namespace tdist::comm::algorithms
