#pragma once
// RingProcessGroup: the "ring" backend: every collective on CPU tensors over a full TCP mesh.
//
// Execution: each call validates its arguments on the caller's thread (InvalidArgument) and
// describes the operation (an OpBody: the op table, ring_process_group_ops.cpp); the OpQueue
// (op_queue.h) gives it a sequence number and runs the queue in order on one worker thread per
// group, or on a caller that waits on the next operation due (Note [Waiter runs the operation]
// in op_queue.cpp). Running it (run()) does the socket I/O itself through an Exchange (no I/O
// thread in between); continuations run on the thread that ran it. send/recv go to the
// P2PEngine on their own channel and thread.
//
// Failure: a timeout or a broken connection in any operation aborts the group: the sockets are
// shut down (so every peer blocked on this rank fails at once instead of at its deadline),
// queued and later operations fail at once with an error that names the cause. A fingerprint
// mismatch (TDIST_DEBUG=DETAIL) fails that operation only. Destroying the group fails whatever
// is still queued and joins its threads; it never waits on a peer.
//
// Knobs read when the group is created (tests and benchmarks use them):
//   TDIST_CHUNK_BYTES        pipelining chunk of the ring algorithms (default 256 KiB)
//   TDIST_ALLREDUCE_ALGO     auto | ring | recursive_doubling | hierarchical | single_copy
//                            (default auto: recursive doubling up to the small size, above it
//                            hierarchical when the group spans hosts of equal rank counts, else
//                            ring; hierarchical where the group has no such hosts, and
//                            single_copy where it cannot read every peer, run the ring;
//                            Note [Single-copy allreduce] in algorithms/single_copy.h)
//   TDIST_SMALL_ALLREDUCE_BYTES  auto: recursive doubling up to this size (default 64 KiB)
//   TDIST_STAGING_PIECE_BYTES    piece of the overlapped staging of CUDA tensors (default 1 MiB;
//                            0: copy them in and out whole, Note [Overlapped staging])
//   TDIST_WINDOW_BYTES       the window of the ring and recursive-doubling allreduces, the
//                            allgather, reduce-scatter, broadcast and reduce, and of staged
//                            gathers, scatters, alltoalls and messages (default 64 MiB; the
//                            group takes the largest of its ranks' values: Note [Windows])
//   TDIST_HOST_ID            this rank's host key when Options::host is unset (Note [Host key])
//   TDIST_SPIN_US            microseconds to re-try transfers before sleeping (default 50 with
//                            shared-memory peers, else 0: Note [Spin, then sleep])
//   TDIST_BUSY_POLL_NS       nanoseconds of each spin that re-try without yielding (default
//                            2000 when the host's ranks fit on this process's CPUs, else 0)
//   TDIST_TRANSPORT          auto (shared memory with same-host peers, else TCP) | tcp
//   TDIST_SHM_BYTES          shared-memory ring bytes per direction (default 2 MiB)
//   TDIST_SINGLE_COPY        1 (default) | 0: large allgathers and broadcasts read the peers'
//                            memory when every rank may (Note [Single-copy collectives]), and
//                            symmetric_empty shares memory (Note [Symmetric memory])
//   TDIST_SINGLE_COPY_BYTES  broadcasts (world 2) and allgather blocks from this many bytes
//                            (default 256 KiB); the group takes the largest of its ranks' values
//   TDIST_ALLGATHER_ALGO     auto (default: timed at set-up) | ring | single_copy
//                            (Note [Which allgather] in ring_process_group.cpp)
//   TDIST_DEBUG=DETAIL       fingerprint check before every collective
//   TDIST_RUN_ON_WAITER      1 (default): Work::wait() runs the next due operation on the
//                            waiting thread (Note [Waiter runs the operation]); 0: the worker only
//
// Thread safety: every public method may be called from any thread.

#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "tdist/comm/algorithms/allreduce_hierarchical.h"
#include "tdist/comm/engine/exchange.h"
#include "tdist/comm/engine/fingerprint.h"
#include "tdist/comm/engine/p2p_engine.h"
#include "tdist/comm/process_group.h"
#include "tdist/comm/ring/op_queue.h"
#include "tdist/comm/ring/ring_tuning.h"
#include "tdist/comm/ring/symmetric_memory.h"
#include "tdist/comm/transport/channels.h"
#include "tdist/comm/transport/tcp/mesh.h"

namespace tdist::comm::detail {

class StagedTensors;  // ring/staging.h

class RingProcessGroup final : public ProcessGroup, private OpQueue::Runner {
 public:
  // `root_store` is the store every group of this job shares; the group's own keys live under
  // `prefix`. Blocks until the mesh is connected (TimeoutError after opts.timeout).
  RingProcessGroup(std::shared_ptr<Store> root_store, std::string prefix, int rank, int size,
                   Options opts);
  ~RingProcessGroup() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override { return "ring"; }
  const Options& options() const override { return opts_; }
  // The group's hosts when the hierarchical allreduce can run (Note [Hierarchical allreduce]);
  // null otherwise.
  const algorithms::Hierarchy* hierarchy() const { return hierarchy_ ? &*hierarchy_ : nullptr; }
  // The group's single-copy threshold (Note [Single-copy collectives]); kNoSingleCopy when the
  // group does not use it.
  uint64_t single_copy_bytes() const { return single_copy_bytes_; }
  // Allgather blocks of at least this many bytes are copied once (Note [Which allgather]);
  // kNoSingleCopy when none is.
  uint64_t allgather_single_copy_bytes() const { return allgather_single_copy_bytes_; }
  // The window the group agreed on (Note [Windows]).
  size_t window_bytes() const { return window_bytes_; }
  static constexpr uint64_t kNoSingleCopy = UINT64_MAX;
  // What the last operation this group ran did on this rank (steps, bytes, wake-ups); read it
  // once that operation completed and before the next starts.
  Exchange::Counts last_counts() const { return exchange_->counts(); }

  // Each operation goes to its start() (Note [One operation table] in comm/calls.h).
  std::shared_ptr<Work> submit(Call call) override;

  using ProcessGroup::new_group;
  std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks, const Options& opts) override;
  void abort() override;
  // Note [Symmetric memory] in symmetric_memory.cpp: plain memory where the group does not read
  // its peers (Note [Single-copy collectives]).
  at::Tensor symmetric_empty(const std::vector<int64_t>& sizes, at::ScalarType dtype) override;
  bool is_symmetric(const at::Tensor& t) const override;

 private:
  // The operations, one function each (the op table): they check the arguments on the
  // caller's thread and return the operation's Work at once. One specialization per Call, in
  // ring_process_group_ops.cpp; one missing fails the link.
  template <class C>
  std::shared_ptr<Work> start(C& call);

  using Run = OpBody::Run;
  using Kind = OpKind;

  // Queue a collective (ops_->push); its Work comes back at once (already failed when the group
  // is aborted). enqueue_small: an operation of a small kind (no Run built).
  std::shared_ptr<Work> enqueue(const char* name, Millis timeout, Fingerprint fp, Run run);
  std::shared_ptr<Work> enqueue_small(const char* name, Kind kind, Millis timeout, Fingerprint fp,
                                      SmallArgs args);
  // OpQueue::Runner: runs a queued operation on the thread that took it.
  Future::Result run(OpQueue::Op& op, Clock::time_point began) override;
  // What the algorithms run with: this group's exchange, tuning, scratch and peers.
  algorithms::Context context();
  void fatal(std::exception_ptr error) override { abort_with(std::move(error)); }
  // Runs a small operation (any kind but kRun).
  Future::Result run_small(algorithms::Context& c, Kind kind, SmallArgs& a);
  std::shared_ptr<Work> post_p2p(bool is_send, at::Tensor tensor, int peer, int tag,
                                 Millis timeout);
  void abort_with(std::exception_ptr cause);
  Millis effective(Millis timeout) const { return timeout.count() < 0 ? opts_.timeout : timeout; }
  algorithms::ReduceSpec reduce_spec(const at::Tensor& t, ReduceOp op) const;
  // The algorithm allreduce_flat runs for `count` elements of `elem` bytes.
  enum class AllreduceAlgo {
    kRecursiveDoubling,
    kHalvingDoubling,
    kHierarchical,
    kRing,
    kSingleCopy
  };
  AllreduceAlgo allreduce_algorithm(size_t count, size_t elem) const;
  void allreduce_flat(algorithms::Context& c, char* data, size_t count,
                      const algorithms::ReduceSpec& rs) const;
  // Single copy from a size on (Note [Single-copy collectives]), else the pipelined chain / ring.
  void broadcast_bytes(algorithms::Context& c, char* data, size_t bytes, int root,
                       algorithms::Staging* staging = nullptr) const;
  void allgather_blocks(algorithms::Context& c, const std::vector<char*>& blocks,
                        size_t block_bytes, algorithms::Staging* staging = nullptr) const;
  // Window by window (Note [Windows]): broadcast_bytes, the chain reduce (in place),
  // allgather_blocks and the ring reduce-scatter.
  void broadcast_windows(algorithms::Context& c, char* data, size_t bytes, int root) const;
  // Note [Symmetric memory]: when the group ever allocated symmetric memory and the operation
  // moves more than the small size (`op_bytes`, the same on every rank), swaps the descriptor of
  // `bytes` at `data` with the peers and returns the segment when every rank's lies in one, with
  // each rank's buffer in `buffers`; else null, on every rank alike.
  std::shared_ptr<SymmetricMemory::Segment> agree_mapped(algorithms::Context& c, const char* data,
                                                         size_t bytes, size_t op_bytes,
                                                         std::vector<const char*>* buffers) const;
  void reduce_windows(algorithms::Context& c, char* data, size_t count,
                      const algorithms::ReduceSpec& rs, int root) const;
  void allgather_windows(algorithms::Context& c, const std::vector<char*>& blocks,
                         size_t block_bytes) const;
  void reduce_scatter_windows(algorithms::Context& c, const std::vector<const char*>& blocks,
                              char* output, size_t count, const algorithms::ReduceSpec& rs) const;
  // Note [Overlapped staging]. The ring allreduce of `ts` (one dtype, reduced as if
  // concatenated) staged piecewise, or null when the group would not run the ring or the tensors
  // are not staged (StagedTensors::wanted).
  std::shared_ptr<Work> allreduce_staged(const char* name, const std::vector<at::Tensor>& ts,
                                         const algorithms::ReduceSpec& rs, Millis timeout,
                                         Fingerprint fp);
  // The allgather of `input` into `outputs` (every rank's block, in rank order), staged window
  // by window, each block copied out as soon as it landed; or null when they are not staged.
  // The Work's value is `result`.
  std::shared_ptr<Work> allgather_staged(const char* name, const at::Tensor& input,
                                         const std::vector<at::Tensor>& outputs,
                                         Future::Value result, Millis timeout, Fingerprint fp);
  // The broadcast and the reduce of `tensor` from and to `root`, staged window by window, or
  // null when it is not staged.
  std::shared_ptr<Work> broadcast_staged(const at::Tensor& tensor, int root, Millis timeout,
                                         Fingerprint fp);
  std::shared_ptr<Work> reduce_staged(const at::Tensor& tensor, const algorithms::ReduceSpec& rs,
                                      int root, Millis timeout, Fingerprint fp);
  // The gather of `mine` (this rank's input) into the root's `theirs` (its outputs), or the
  // scatter of the root's `theirs` (its inputs) into `mine` (this rank's output), staged window by
  // window, or null when they are not staged. The Work's value is `result`.
  std::shared_ptr<Work> gather_or_scatter_staged(bool gather, const at::Tensor& mine,
                                                 const std::vector<at::Tensor>& theirs, int root,
                                                 Future::Value result, Millis timeout,
                                                 Fingerprint fp);
  // The alltoall of `sends` (this rank's block for every rank, flat bytes) into `recvs` (every
  // rank's block for this one), staged window by window; `all` are the caller's tensors, which
  // StagedTensors::wanted accepted. The Work's value is `result`.
  std::shared_ptr<Work> alltoall_staged(const char* name, std::vector<at::Tensor> sends,
                                        std::vector<at::Tensor> recvs,
                                        const std::vector<at::Tensor>& all, Future::Value result,
                                        Millis timeout, Fingerprint fp);
  // The ring reduce-scatter of `inputs` (every rank's block, in rank order, as if concatenated)
  // into `output`, staged window by window, or null when they are not staged.
  std::shared_ptr<Work> reduce_scatter_staged(const char* name,
                                              const std::vector<at::Tensor>& inputs,
                                              const at::Tensor& output,
                                              const algorithms::ReduceSpec& rs, Millis timeout,
                                              Fingerprint fp);

  // Constant after construction.
  const std::shared_ptr<Store> root_store_;
  const std::string prefix_;
  const int rank_;
  const int size_;
  const Options opts_;
  // From ProcessGroup::Options::ring, the environment or the defaults (ring_tuning.h).
  size_t chunk_bytes_ = 0;
  AllreduceChoice allreduce_algo_ = AllreduceChoice::kAuto;
  size_t small_allreduce_bytes_ = 0;
  size_t staging_piece_bytes_ = 0;  // Note [Overlapped staging]
  size_t window_bytes_ = 0;         // Note [Windows]
  bool debug_detail_ = false;
  std::unique_ptr<tcp::Mesh> mesh_;
  std::vector<std::unique_ptr<Channel>> channels_;  // collective channel per peer
  std::optional<algorithms::Hierarchy> hierarchy_;
  // Allgather blocks and broadcasts of at least this many bytes are copied once, straight from
  // the owner's memory (Note [Single-copy collectives]): the group's agreed threshold, or
  // kNoSingleCopy. peer_pids_: every rank's process when it is not kNoSingleCopy.
  uint64_t single_copy_bytes_ = kNoSingleCopy;
  uint64_t allgather_single_copy_bytes_ = kNoSingleCopy;  // Note [Which allgather]
  std::vector<pid_t> peer_pids_;
  std::unique_ptr<SymmetricMemory> symmetric_;  // where peer_pids_ is known
  // The collectives' queue, made first (its aborted() flag is the group's) and stopped and
  // joined in the destructor before anything it runs on goes.
  std::unique_ptr<OpQueue> ops_;
  // Used by the thread that runs an operation (OpQueue: one at a time).
  std::unique_ptr<Exchange> exchange_;
  algorithms::Scratch scratch_;
  std::vector<char*> blocks_;           // size_ capacity
  std::vector<const char*> in_blocks_;  // size_ capacity
  std::unique_ptr<P2PEngine> p2p_;

  std::atomic<uint64_t> next_p2p_seq_{0};
  std::atomic<int> next_subgroup_{0};
};

}  // namespace tdist::comm::detail
