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
// copies each byte once instead: every rank tells the ranks that need its data where that data
// is (an 8-byte address over the collective channel), each of them copies it straight into its
// own output with process_vm_readv, and each then tells the owner it is done (one byte), so no
// rank returns (and lets its caller reuse the buffer) while a peer may still be reading it.
// Ranks only read: no rank writes into another's memory. A writer could not know that its
// peer is still in the operation: a root stopped (SIGSTOP, a frozen container, a paused VM)
// after the peer's address came, and resumed after the peer had timed out and freed the
// buffer, would write into whatever the peer keeps there now. A late reader harms only its
// own output, which it then fails. (Until 2026-11-28 the world-2 broadcast's root wrote half
// into its peer with process_vm_writev, so that both cores copied.)
// The address message carries the size too: ranks that called the operation with different
// sizes all fail it (MismatchError; the group stays usable) before any memory is touched, so no
// rank ever writes past the end of a peer's buffer or reads past the end of a peer's data.
// No rank waits for another between the address and the done message: a rank whose peers are
// descheduled (four ranks on two cores) still copies at once, and the copies of all ranks run
// in parallel. Open MPI's shared-memory transport does the same (CMA).
// The group uses it when every rank allows it (TDIST_SINGLE_COPY, default on) and can read
// every peer: world-2 broadcasts of at least TDIST_SINGLE_COPY_BYTES (default 256 KiB;
// RingProcessGroup::broadcast_bytes says why) and allgathers whose blocks are large enough
// (Note [Which allgather] in ring/ring_process_group.cpp: the group measures both allgathers
// when it is made). At set-up every rank sends every peer its threshold (the largest value, when
// disabled or a peer is unreadable) and the group takes the largest, so ranks with different
// settings still agree. A peer that dies mid-copy makes the read fail (ESRCH), an error that
// names the rank; a peer that stops is noticed at the done message's deadline. A peer that
// failed the operation first (a third rank was lost) may have freed its buffer: the read fails
// with EFAULT, an error that names that peer as lost too, or reads what is there now into an
// output that fails anyway (that peer's done message never comes).

// Broadcast by single copy between two ranks: the other rank reads the root's `data` into its
// own. With `staging` as for broadcast_pipelined (the root's address leaves once its data
// arrived).
void broadcast_single_copy(Context& c, char* data, size_t bytes, int root,
                           Staging* staging = nullptr);
// Allgather by single copy: every rank reads blocks[i] from rank i's blocks[i]. With `staging`
// as for allgather_ring.
void allgather_single_copy(Context& c, const std::vector<char*>& blocks, size_t block_bytes,
                           Staging* staging = nullptr);

// Note [Single-copy allreduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The ring allreduce makes 2(n-1) hops one after the other, each a wait for the left
// neighbour (a wake-up when it sleeps); recursive doubling log2 n rounds that each move the
// whole buffer. Where every rank may read every peer (Note [Single-copy collectives]) the
// allreduce is a reduce-scatter and an allgather that read the peers' buffers directly:
//   1. every rank sends every peer its buffer's address and size (a mismatch fails here);
//   2. rank s reduces its segment s (count / n elements, the last ones shorter) by reading
//      segment s of each peer's buffer into scratch and reducing it into its own;
//   3. all ranks meet (one byte to and from each peer): every segment is final on its owner;
//   4. every rank reads each peer's own segment into the same place of its buffer;
//   5. all ranks meet again, so no rank returns while a peer still reads its buffer.
// In step 2 a rank writes only its own segment, which no peer reads before step 4; in step 4
// it writes only the others' segments, which nobody reads any more. Each segment is reduced by
// one rank and copied to the others, so every rank ends bit-identical. Each rank waits three
// times whatever the world size (steps 1, 3 and 5) and copies 2(n-1)/n of the buffer, the
// same bytes as the ring's hops but once each and with no forwarding.
void allreduce_single_copy(Context& c, char* data, size_t count, const ReduceSpec& rs);

// Note [Mapped allreduce]
// ~~~~~~~~~~~~~~~~~~~~~~~
// The single-copy allreduce with every peer's buffer mapped into this process (Note [Symmetric
// memory] in ring/symmetric_memory.cpp), so that nothing is copied to be read: buffers[p] is
// rank p's buffer (this rank's is buffers[rank], written; the others are only read). The ranks
// have just swapped their buffers' descriptors, after their callers wrote them, which is step 1
// of Note [Single-copy allreduce]; then rank s reduces segment s of every buffer straight into
// its own, all meet, each copies the others' final segments, and all meet again. Per rank at
// world 2 that reads 1.5 and writes 1 times the buffer, against the ring's 2.5 and 2.
void allreduce_mapped(Context& c, const std::vector<const char*>& buffers, size_t count,
                      const ReduceSpec& rs);

// The broadcast and the allgather of mapped buffers, in the same way: after the swap of
// descriptors every rank but the root copies `bytes` from the root's buffer (buffers[root]) into
// its own (buffers[rank]); an allgather copies each peer's block from where it lies in that
// peer's buffer (sources[p]) into blocks[p] of this rank, starting with its right neighbour. Then
// all meet, so that no rank writes its buffer while a peer still reads it. One copy per byte, no
// system call, against the single copy's process_vm_readv, which pins the peer's pages per call.
void broadcast_mapped(Context& c, const std::vector<const char*>& buffers, size_t bytes, int root);
void allgather_mapped(Context& c, const std::vector<const char*>& sources,
                      const std::vector<char*>& blocks, size_t block_bytes);

// The reduce-scatter of mapped inputs: inputs[p] is rank p's input (n blocks of `count`
// elements one after another; this rank's is inputs[rank]). This rank reduces block `rank` of
// every input, starting with its own and then its right neighbour's, straight into `output`
// (elsewhere, or this rank's own block: no peer reads that one), then all meet, so that no rank
// writes its input while a peer still reads it. Per rank (n - 1) / n of the input read across
// cores once, against the ring's copy into a channel and out of it.
void reduce_scatter_mapped(Context& c, const std::vector<const char*>& inputs, char* output,
                           size_t count, const ReduceSpec& rs);

}  // namespace tdist::comm::algorithms
