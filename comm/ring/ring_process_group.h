#pragma once
// RingProcessGroup: the "ring" backend: every collective on CPU tensors over a full TCP mesh.
//
// Execution: each call validates its arguments on the caller's thread (InvalidArgument), takes a
// sequence number and queues the operation; one worker thread per group runs the queue in order,
// doing the socket I/O itself through an Exchange (no I/O thread in between), and completes the
// Work's future (continuations run on the worker), unless a caller that waits on the operation
// runs it first on its own thread (Note [Waiter runs the operation] in ring_process_group.cpp). send/recv go to the P2PEngine on their own
// channel and thread.
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
//                            memory when every rank may (Note [Single-copy collectives])
//   TDIST_SINGLE_COPY_BYTES  allgather blocks (world 3 and more) and broadcasts (world 2) from
//                            this many bytes (default 256 KiB); the group takes the largest
//                            of its ranks' values
//   TDIST_DEBUG=DETAIL       fingerprint check before every collective
//   TDIST_RUN_ON_WAITER      1 (default): Work::wait() runs the next due operation on the
//                            waiting thread (Note [Waiter runs the operation]); 0: the worker only
//
// Thread safety: every public method may be called from any thread.

#include <atomic>
#include <condition_variable>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "tdist/comm/algorithms/allreduce_hierarchical.h"
#include "tdist/comm/engine/exchange.h"
#include "tdist/comm/engine/fingerprint.h"
#include "tdist/comm/engine/p2p_engine.h"
#include "tdist/comm/process_group.h"
#include "tdist/comm/transport/channels.h"
#include "tdist/comm/transport/tcp/mesh.h"

namespace tdist::comm::detail {

class StagedTensors;  // ring/staging.h

class RingProcessGroup final : public ProcessGroup {
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
  // The window the group agreed on (Note [Windows]).
  size_t window_bytes() const { return window_bytes_; }
  static constexpr uint64_t kNoSingleCopy = UINT64_MAX;
  // What the last operation this group ran did on this rank (steps, bytes, wake-ups); read it
  // once that operation completed and before the next starts.
  Exchange::Counts last_counts() const { return exchange_->counts(); }

  std::shared_ptr<Work> broadcast(at::Tensor tensor, const BroadcastOptions& opts) override;
  std::shared_ptr<Work> allreduce(at::Tensor tensor, const AllreduceOptions& opts) override;
  std::shared_ptr<Work> allreduce_coalesced(std::vector<at::Tensor> tensors,
                                            const AllreduceCoalescedOptions& opts) override;
  std::shared_ptr<Work> reduce(at::Tensor tensor, const ReduceOptions& opts) override;
  std::shared_ptr<Work> allgather(std::vector<at::Tensor> outputs, at::Tensor input,
                                  const AllgatherOptions& opts) override;
  std::shared_ptr<Work> allgather_into_tensor(at::Tensor output, at::Tensor input,
                                              const AllgatherOptions& opts) override;
  std::shared_ptr<Work> gather(std::vector<at::Tensor> outputs, at::Tensor input,
                               const GatherOptions& opts) override;
  std::shared_ptr<Work> scatter(at::Tensor output, std::vector<at::Tensor> inputs,
                                const ScatterOptions& opts) override;
  std::shared_ptr<Work> reduce_scatter(at::Tensor output, std::vector<at::Tensor> inputs,
                                       const ReduceScatterOptions& opts) override;
  std::shared_ptr<Work> reduce_scatter_tensor(at::Tensor output, at::Tensor input,
                                              const ReduceScatterOptions& opts) override;
  std::shared_ptr<Work> alltoall_base(at::Tensor output, at::Tensor input,
                                      std::vector<int64_t> output_splits,
                                      std::vector<int64_t> input_splits,
                                      const AllToAllOptions& opts) override;
  std::shared_ptr<Work> alltoall(std::vector<at::Tensor> outputs, std::vector<at::Tensor> inputs,
                                 const AllToAllOptions& opts) override;
  std::shared_ptr<Work> barrier(const BarrierOptions& opts) override;
  std::shared_ptr<Work> send(at::Tensor tensor, int dst, int tag,
                             const SendRecvOptions& opts) override;
  std::shared_ptr<Work> recv(at::Tensor tensor, int src, int tag,
                             const SendRecvOptions& opts) override;
  std::shared_ptr<Work> recv_any_source(at::Tensor tensor, int tag,
                                        const SendRecvOptions& opts) override;

  using ProcessGroup::new_group;
  std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks, const Options& opts) override;
  void abort() override;

 private:
  using Run = std::function<Future::Value(algorithms::Context&)>;
  // The small operations whose arguments the Op keeps itself rather than in a capturing Run
  // (which would allocate): Note [Small operations] in ring_process_group.cpp.
  enum class Kind {
    kRun,                  // op.run
    kAllreduce,            // `work` reduced in place
    kBroadcast,            // `work` from args.root
    kAllgatherInto,        // `in` (this rank's block) into `work`, size_ blocks
    kAllgatherList,        // `in` into `list` (one contiguous host tensor per rank)
    kReduceScatterTensor,  // `in` (size_ blocks) reduced into `work`
    kReduceScatterList,    // `list` (one contiguous host tensor per rank) reduced into `work`
  };
  struct SmallArgs {
    at::Tensor orig;  // the caller's tensor (the output, where the op has one)
    at::Tensor work;  // its contiguous host values (orig itself when it is one)
    at::Tensor in;    // the contiguous host values of an allgather's or reduce-scatter's input
    std::vector<at::Tensor> list;  // the caller's list, moved in (given back as the result)
    algorithms::ReduceSpec rs{};
    int root = 0;
  };
  struct Op {
    const char* name;
    uint64_t seq;
    Millis timeout;
    std::shared_ptr<Future> future;
    Fingerprint fingerprint;
    Kind kind = Kind::kRun;
    Run run;         // kRun only
    SmallArgs args;  // every other kind
    Clock::time_point enqueued;
    bool worker_told = false;  // guarded by mu_: the worker was notified of this op
  };
  // Ops live in list nodes that move between queue_, the thread running them and free_ops_ by
  // splicing, so a warm group queues an operation without allocating.
  using OpList = std::list<std::unique_ptr<Op>>;

  // Queues a collective; returns its Work at once (already failed when the group is aborted).
  std::shared_ptr<Work> enqueue(const char* name, Millis timeout, Fingerprint fp, Run run);
  // The same for a small operation (no Run built).
  std::shared_ptr<Work> enqueue_small(const char* name, Kind kind, Millis timeout, Fingerprint fp,
                                      SmallArgs args);
  std::shared_ptr<Work> enqueue_impl(const char* name, Kind kind, Millis timeout, Fingerprint fp,
                                     Run* run, SmallArgs* args);
  // Runs a small operation (any kind but kRun) on the thread that holds running_.
  Future::Value run_small(algorithms::Context& c, Kind kind, SmallArgs& a);
  std::shared_ptr<Work> post_p2p(bool is_send, at::Tensor tensor, int peer, int tag,
                                 Millis timeout);
  void worker_loop();
  // `now`: when the operation starts (its deadline counts from it). `node` holds the op alone;
  // it goes back to free_ops_ before the op's future completes.
  void execute(OpList& node, Clock::time_point now);
  // Note [Waiter runs the operation]: the Work's progress hook.
  void progress(uint64_t seq, bool may_run_here);
  // Notifies the worker of every queued op it was not told of; call with mu_ held, then
  // notify cv_ when it returns true.
  bool tell_worker_locked();
  // Clears running_ and takes back `node`'s op (its fields reset) into free_ops_.
  void finish_running(OpList& node);
  void abort_with(std::exception_ptr cause);
  std::exception_ptr aborted_error(const char* name, uint64_t seq) const;
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
  std::string allreduce_algo_;
  size_t small_allreduce_bytes_ = 0;
  size_t staging_piece_bytes_ = 0;  // Note [Overlapped staging]
  size_t window_bytes_ = 0;         // Note [Windows]
  bool debug_detail_ = false;
  bool run_on_waiter_ = true;
  std::unique_ptr<tcp::Mesh> mesh_;
  std::vector<std::unique_ptr<Channel>> channels_;  // collective channel per peer
  std::optional<algorithms::Hierarchy> hierarchy_;
  // Allgather blocks and broadcasts of at least this many bytes are copied once, straight from
  // the owner's memory (Note [Single-copy collectives]): the group's agreed threshold, or
  // kNoSingleCopy. peer_pids_: every rank's process when it is not kNoSingleCopy.
  uint64_t single_copy_bytes_ = kNoSingleCopy;
  std::vector<pid_t> peer_pids_;
  std::unique_ptr<Exchange> exchange_;  // used by the thread that set running_
  algorithms::Scratch scratch_;         // used by the thread that set running_
  std::vector<char*> blocks_;           // used by the thread that set running_ (size_ capacity)
  std::vector<const char*> in_blocks_;  // used by the thread that set running_ (size_ capacity)
  std::unique_ptr<P2PEngine> p2p_;

  std::atomic<bool> aborted_{false};
  std::atomic<uint64_t> next_p2p_seq_{0};
  std::atomic<int> next_subgroup_{0};

  mutable std::mutex mu_;
  std::condition_variable cv_;
  OpList queue_;                    // guarded by mu_
  OpList free_ops_;                 // guarded by mu_: reset ops for later operations
  uint64_t next_seq_ = 0;           // guarded by mu_
  bool running_ = false;            // guarded by mu_: an op is executing (worker or waiter)
  bool lazy_ = false;               // guarded by mu_: new ops are left for their waiter
  int prompt_waits_ = 0;            // guarded by mu_: ops waited on promptly in a row
  bool stop_ = false;               // guarded by mu_
  std::exception_ptr abort_cause_;  // guarded by mu_
  std::thread worker_;
};

}  // namespace tdist::comm::detail
