#pragma once
// Large tensors between processes of one host through shared-memory slots: one copy per message.
//
// Note [RPC shared-memory slots]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With the same-host fast path a receiver used to read a large tensor out of the sender's memory
// with process_vm_readv: one copy, but the kernel's copy runs at about 0.4 of one core's memcpy
// (it pins and maps the sender's pages 4 KiB at a time), so a 16 MiB echo could not pass 0.6 of
// the memcpy bound even split over two threads. Now a sender copies such a tensor (memcpy) into a
// slot: a memfd it created and mapped, whose first page holds a header (magic, the slot's random
// 64-bit tag, its capacity), the bytes after it. The frame names the slot (the memfd's descriptor
// number in the sender and the tag, TensorSection::shm) besides the usual address. The receiver
// maps the slot once (opening /proc/<sender pid>/fd/<n>: allowed by the same kernel check as
// process_vm_readv, which the handshake already passed), checks the header, and hands the user a
// tensor that lives in the mapping: no copy on this side. When that tensor dies, its storage's
// deleter queues the tag, and the next frame the receiver sends on that connection carries a
// SHM_RELEASE for it; the sender may then reuse the slot. So each direction costs one memcpy by
// the sender, and a receiver that keeps a tensor keeps its slot busy, not a copy of it.
//
// - Slots are reused by size (a free slot of at least the size and at most twice it), mapped on
//   both sides for their life, so a steady exchange of same-sized tensors maps and faults nothing.
// - A sender's slots on one connection hold at most a cap of bytes (RpcOptions::shm_bytes), and
//   a process holds at most kMaxProcessSlots slots in all (each keeps a descriptor open until
//   it is retired: the receiver opens it through /proc when it first sees the slot, so slots
//   must not eat the descriptors that sockets need); to make room a sender retires its least
//   recently used free slots and names them in the tensor section of the next frame that has
//   one (TensorSection::retired; a frame that fails to be built leaves them to the one after),
//   and the receiver drops its mappings of them (tensors still in one keep it mapped). When no
//   room can be made, memfd_create or fallocate fail (no shared memory left: fallocate reserves
//   the pages, so a full tmpfs is an error here, never a SIGBUS later), the tensor goes by
//   process_vm_readv as before.
// - A receiver that cannot open or map a slot (a /proc that hides other processes) reads that
//   tensor with process_vm_readv from the address the frame also gives and releases the slot at
//   once; it stops trying slots on that connection.
// - A descriptor that /proc does not name as a memfd of tdist's slot name (checked before it is
//   opened), a slot not sealed against shrinking and growing (F_SEAL_SHRINK, F_SEAL_GROW: a
//   slot that shrank under our mapping would make the receiver's next touch of it SIGBUS), or a
//   slot whose header does not match what the frame says (wrong magic, tag or too small), is a
//   ProtocolError: the connection closes.
// - When a connection closes the sender unmaps and closes its slots; a received tensor stays
//   valid (its mapping is held by the tensor), whatever happens to the sender afterwards.
// - A received tensor's storage is ordinary resizable CPU storage: growing it copies it out of
//   the slot (and releases the slot).

#include <sys/types.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "tdist/core/tensor_wire.h"
#include "tdist/rpc/detail/message.h"

namespace tdist::rpc::detail {

// Tags of slots whose receiver is done with them, queued by the deleters of received tensors
// (any thread) until the connection next writes.
class ReleaseQueue {
 public:
  void push(uint64_t tag);
  std::vector<uint64_t> take();

 private:
  std::mutex mu_;
  std::vector<uint64_t> tags_;
};

// The sending side's slots of one connection. Thread safety: every method from any thread.
class ShmSlots {
 public:
  explicit ShmSlots(uint64_t cap_bytes) : cap_(cap_bytes) {}
  ~ShmSlots();
  ShmSlots(const ShmSlots&) = delete;
  ShmSlots& operator=(const ShmSlots&) = delete;

  struct Put {
    ShmRef ref;
    uint64_t address = 0;  // of the bytes in this process (the receiver's fallback)
  };
  // Copies `bytes` bytes of `src` into a free slot (made if needed) and marks it busy; nullopt
  // when no slot can be had (see the Note). Slots retired to make room wait in take_retired()
  // for a frame to name them.
  std::optional<Put> put(const void* src, uint64_t bytes);
  // Tags of retired slots the receiver was not yet told of, at most `max` (the rest stay), for
  // the frame being built; a frame that then fails hands them back with untake_retired(), so a
  // receiver is never left holding the mapping of a slot nobody will name again.
  std::vector<uint64_t> take_retired(size_t max);
  void untake_retired(const std::vector<uint64_t>& tags);
  // The receiver is done with slot `tag`; unknown or free tags are ignored (false).
  bool release(uint64_t tag);

  uint64_t bytes_held() const;
  size_t busy() const;
  // Slots of every connection of this process.
  static int64_t process_slots();

 private:
  struct Slot {
    int fd = -1;
    uint8_t* base = nullptr;
    uint64_t capacity = 0;
    uint64_t mapped = 0;
    bool busy = false;
    uint64_t last_use = 0;
  };
  // Room for a new slot of `mapped` bytes, with one of the process's kMaxProcessSlots reserved
  // for it (destroy() gives it back); false if the busy slots alone leave none.
  bool make_room(uint64_t mapped);
  static void destroy(Slot& s);

  const uint64_t cap_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Slot> slots_;  // by tag; guarded by mu_
  uint64_t held_ = 0;                         // guarded by mu_
  uint64_t clock_ = 0;                        // guarded by mu_
  std::vector<uint64_t> retired_;             // not yet named in a frame; guarded by mu_
};

// The receiving side's mappings of one connection's peer slots. Reader thread only.
class ShmMappings {
 public:
  // A tensor of `meta` in the peer's slot `ref`, whose storage queues `ref.tag` on `releases`
  // when it dies; nullopt when the slot cannot be opened or mapped (the caller falls back).
  // ProtocolError when the slot's header contradicts the frame.
  std::optional<at::Tensor> tensor(pid_t pid, const ShmRef& ref, const TensorMeta& meta,
                                   const std::shared_ptr<ReleaseQueue>& releases);
  void retire(uint64_t tag) { maps_.erase(tag); }

  struct Mapping;

 private:
  std::unordered_map<uint64_t, std::shared_ptr<Mapping>> maps_;
  bool disabled_ = false;
};

// A random non-zero 64-bit tag naming a slot or a stream.
uint64_t new_shm_tag();

// A memfd made by this process, sealed against resizing (F_SEAL_SHRINK | F_SEAL_GROW |
// F_SEAL_SEAL), its pages reserved (fallocate) and mapped read-write: the memory of slots and of
// frame streams (rpc/detail/shm_stream.h). nullopt, errno set, when no shared memory can be had.
struct SealedMemfd {
  int fd = -1;
  uint8_t* base = nullptr;
  uint64_t bytes = 0;
};
std::optional<SealedMemfd> create_sealed_memfd(const char* name, uint64_t bytes);

// The peer's memfd `fd`, opened through /proc/<pid>/fd and mapped read-write (the caller
// unmaps it). nullopt when /proc does not let us see, open or map it (`why` says why; the caller
// falls back); ProtocolError when the descriptor is not a memfd named `name` of `min_bytes` to
// `max_bytes` bytes sealed against resizing (`what` names it in the message): the size of what
// is mapped (and populated) is bounded by what the caller expects, never the peer's choice.
struct PeerMapping {
  void* base = nullptr;
  size_t length = 0;
};
std::optional<PeerMapping> map_peer_memfd(pid_t pid, int fd, const char* name, const char* what,
                                          uint64_t min_bytes, uint64_t max_bytes, std::string* why);

// The first word of a slot's header page ("TDSHMBUF"); the slot's tag and capacity follow.
constexpr uint64_t kShmSlotMagic = 0x4655424d48534454;
// Bytes of the header page in front of a slot's data.
constexpr uint64_t kShmHeaderBytes = 4096;
// Slots (and so descriptors) of all the connections of one process, at most.
constexpr int64_t kMaxProcessSlots = 128;
// At most this many slots of one peer mapped at once (a peer naming more is a ProtocolError).
constexpr size_t kMaxShmMappings = 4096;

}  // namespace tdist::rpc::detail
