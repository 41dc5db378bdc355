#pragma once
// Symmetric memory of a ring group: host buffers that every local process of the group maps, so
// that an allreduce, a broadcast, an allgather or a reduce-scatter of tensors in one reads its
// peers' values where they lie (Note [Symmetric memory] in symmetric_memory.cpp).
// ProcessGroup::symmetric_empty makes one.
//
// Thread safety: allocate(), agree() and used() run on the thread that runs the group's
// operations (one at a time); holds() and the tensors' deleters on any thread.

#include <ATen/core/Tensor.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "tdist/comm/algorithms/context.h"

namespace tdist::comm::detail {

class SymmetricMemory {
 public:
  // One buffer: this rank's mapping (read-write) and every peer's (read-only), by rank.
  struct Segment {
    uint64_t id = 0;  // the same on every rank: the group's count of symmetric buffers
    size_t bytes = 0;
    std::vector<char*> maps;  // by rank, each `bytes` long; maps[rank] is this rank's
    ~Segment();
  };
  // What a rank tells its peers of an operation's buffer.
  struct Descriptor {
    uint64_t id = kNone;  // kNone: not in a live segment of this group
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };
  static constexpr uint64_t kNone = UINT64_MAX;

  // The group's processes by rank (the kernel's word, Note [Single-copy collectives]).
  explicit SymmetricMemory(std::vector<pid_t> pids) : state_(std::make_shared<State>(pids)) {}

  // Collective, as an operation of the group on every rank: allocates a buffer for `sizes` of
  // `dtype` on this rank and maps every peer's. Returns a tensor over it, or an undefined tensor
  // when some rank could not share or map (every rank then logs why and returns the same).
  // MismatchError when the ranks asked for different sizes.
  at::Tensor allocate(algorithms::Context& c, const std::vector<int64_t>& sizes,
                      at::ScalarType dtype);
  // Whether `bytes` at `data` lie in one live segment.
  bool holds(const char* data, size_t bytes) const;
  // Whether any rank ever allocated (the same on every rank: allocate() is collective).
  bool used() const { return used_; }
  // Exchanges the descriptor of `bytes` at `data` with every peer. When every rank's lies in the
  // same live segment, returns it and each rank's buffer (this rank's is `data`); else null (the
  // same answer on every rank, from the same descriptors).
  std::shared_ptr<Segment> agree(algorithms::Context& c, char* data, size_t bytes,
                                 std::vector<const char*>* buffers) const;

 private:
  struct State {
    explicit State(std::vector<pid_t> p) : pids(std::move(p)) {}
    const std::vector<pid_t> pids;
    std::mutex mu;
    std::map<uintptr_t, std::weak_ptr<Segment>> live;  // by this rank's mapping
  };
  Descriptor describe(const char* data, size_t bytes, std::shared_ptr<Segment>* seg) const;

  std::shared_ptr<State> state_;  // the tensors' deleters hold it weakly
  uint64_t next_id_ = 0;          // on the operations' thread only
  bool used_ = false;
};

}  // namespace tdist::comm::detail
