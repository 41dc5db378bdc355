#pragma once
// ProcessGroup: collectives and point-to-point operations among `size()` ranks (c10d's
// ProcessGroup). Every operation returns a Work at once and runs asynchronously; operations of one
// group run in the order they were issued, which must be the same on every rank (as in c10d).
//
// Tensors are CPU or CUDA tensors (a backend is selected per device type; see Options::backend).
// In-place operations (allreduce, broadcast, reduce, send/recv buffers) write into the tensors
// passed; the caller keeps them alive and untouched until the Work completes. Inputs may be
// non-contiguous (they are copied) unless documented otherwise.
//
// Failure: every operation has a deadline (its options' timeout, else the group's). A dead peer,
// a broken connection or a deadline fails the Work on every rank that can see it, with an Error
// naming this rank, the operation, the peer and the sequence number; the group is then aborted:
// later operations fail at once, and destroying the group never hangs. Bad arguments (root out of
// range, wrong output sizes, mismatched dtypes) throw InvalidArgument from the call itself.
//
// Thread safety: operations may be issued from several threads, but the order in which they are
// issued defines their order on the wire and must match across ranks.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tdist/comm/calls.h"
#include "tdist/comm/types.h"
#include "tdist/comm/work.h"
#include "tdist/core/store.h"

namespace tdist::comm {

class ProcessGroup : public std::enable_shared_from_this<ProcessGroup> {
 public:
  struct Options {
    // Default deadline of every operation (c10d's default is 30 minutes).
    Millis timeout = Millis(30 * 60 * 1000);
    // Per device type (Note [Device dispatch], comm/device_dispatch.h): "ring" for every
    // device (CUDA tensors staged through host memory), "cpu:ring,cuda:nccl", or "auto": the
    // latter when this process sees a GPU and the NCCL backend loads, else "ring"
    // (TDIST_CUDA_BACKEND=ring keeps CUDA tensors on the ring, e.g. for ranks sharing a GPU).
    std::string backend = "auto";
    // The job's shared secret: every mesh connection passes the connection handshake with it
    // (core/net/handshake.h). Unset: TDIST_TOKEN / TDIST_TOKEN_FILE (core/token.h).
    std::optional<std::string> token;
    // Ranks with equal host keys are one host: shared memory between them, and the hierarchical
    // allreduce groups ranks by host. Unset: TDIST_HOST_ID, else the machine's boot id and this
    // process's network namespace (Note [Host key], comm/transport/channels.h).
    std::optional<std::string> host;
    // The CUDA device this rank uses (c10d's device_id). Set, the NCCL backend connects when the
    // group is created instead of at its first operation, and a new_group whose options name
    // the same device gets a communicator split from this group's (ncclCommSplit: no new NCCL
    // bootstrap through the store; Note [Split communicators] in comm/nccl/nccl_process_group.h).
    // Unset, each NCCL communicator is created at its first operation. The ring backend does
    // not use it. Must be >= 0.
    std::optional<int> device_id;
    // The ring backend's tunables. Each field left unset takes its environment variable when
    // that is set, else the default (resolve_ring_tuning in comm/ring/ring_tuning.h is the one
    // place that reads them; docs/configuration.md lists every knob with its default and why).
    struct RingTuning {
      std::optional<size_t> chunk_bytes;  // TDIST_CHUNK_BYTES: pipelining chunk
      std::optional<size_t>
          small_allreduce_bytes;  // TDIST_SMALL_ALLREDUCE_BYTES: below, recursive doubling
      std::optional<std::string>
          allreduce_algo;  // TDIST_ALLREDUCE_ALGO: auto|ring|recursive_doubling|
                           // halving_doubling|hierarchical|single_copy
      std::optional<std::string> allgather_algo;  // TDIST_ALLGATHER_ALGO: auto|ring|single_copy
      std::optional<size_t> window_bytes;         // TDIST_WINDOW_BYTES: Note [Windows]
      std::optional<size_t>
          staging_piece_bytes;            // TDIST_STAGING_PIECE_BYTES: Note [Overlapped staging]
      std::optional<bool> debug_detail;   // TDIST_DEBUG=DETAIL: Note [Fingerprint check]
      std::optional<bool> run_on_waiter;  // TDIST_RUN_ON_WAITER
      std::optional<bool> shared_memory;  // TDIST_TRANSPORT=auto (true) | tcp (false)
      std::optional<size_t> shm_bytes;    // TDIST_SHM_BYTES: each ring's capacity
      std::optional<int> spin_us;         // TDIST_SPIN_US: Note [Spin, then sleep]
      std::optional<int> busy_poll_ns;    // TDIST_BUSY_POLL_NS: the same Note
      std::optional<bool> shm_futex;      // TDIST_SHM_FUTEX
      std::optional<bool> single_copy;    // TDIST_SINGLE_COPY
      std::optional<size_t> single_copy_bytes;  // TDIST_SINGLE_COPY_BYTES
    };
    RingTuning ring;
  };

  virtual ~ProcessGroup() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend_name() const = 0;
  virtual const Options& options() const = 0;

  // The operations (Note [One operation table] in comm/calls.h): each builds its Call and
  // submits it.
  std::shared_ptr<Work> broadcast(at::Tensor tensor, const BroadcastOptions& opts = {}) {
    return submit(BroadcastCall{std::move(tensor), opts});
  }
  std::shared_ptr<Work> allreduce(at::Tensor tensor, const AllreduceOptions& opts = {}) {
    return submit(AllreduceCall{std::move(tensor), opts});
  }
  std::shared_ptr<Work> allreduce_coalesced(std::vector<at::Tensor> tensors,
                                            const AllreduceCoalescedOptions& opts = {}) {
    return submit(AllreduceCoalescedCall{std::move(tensors), opts});
  }
  std::shared_ptr<Work> reduce(at::Tensor tensor, const ReduceOptions& opts = {}) {
    return submit(ReduceCall{std::move(tensor), opts});
  }
  // outputs: size() tensors shaped like input.
  std::shared_ptr<Work> allgather(std::vector<at::Tensor> outputs, at::Tensor input,
                                  const AllgatherOptions& opts = {}) {
    return submit(AllgatherCall{std::move(outputs), std::move(input), opts});
  }
  // output: size() * input.numel() elements (c10d's _allgather_base / all_gather_into_tensor).
  std::shared_ptr<Work> allgather_into_tensor(at::Tensor output, at::Tensor input,
                                              const AllgatherOptions& opts = {}) {
    return submit(AllgatherIntoTensorCall{std::move(output), std::move(input), opts});
  }
  // outputs: size() tensors on the root, empty elsewhere.
  std::shared_ptr<Work> gather(std::vector<at::Tensor> outputs, at::Tensor input,
                               const GatherOptions& opts = {}) {
    return submit(GatherCall{std::move(outputs), std::move(input), opts});
  }
  // inputs: size() tensors on the root, empty elsewhere.
  std::shared_ptr<Work> scatter(at::Tensor output, std::vector<at::Tensor> inputs,
                                const ScatterOptions& opts = {}) {
    return submit(ScatterCall{std::move(output), std::move(inputs), opts});
  }
  // inputs: size() tensors shaped like output.
  std::shared_ptr<Work> reduce_scatter(at::Tensor output, std::vector<at::Tensor> inputs,
                                       const ReduceScatterOptions& opts = {}) {
    return submit(ReduceScatterCall{std::move(output), std::move(inputs), opts});
  }
  // input: size() * output.numel() elements (c10d's _reduce_scatter_base).
  std::shared_ptr<Work> reduce_scatter_tensor(at::Tensor output, at::Tensor input,
                                              const ReduceScatterOptions& opts = {}) {
    return submit(ReduceScatterTensorCall{std::move(output), std::move(input), opts});
  }
  // Equal splits along dim 0 when the split lists are empty; otherwise row counts per rank.
  std::shared_ptr<Work> alltoall_base(at::Tensor output, at::Tensor input,
                                      std::vector<int64_t> output_splits,
                                      std::vector<int64_t> input_splits,
                                      const AllToAllOptions& opts = {}) {
    return submit(AlltoallBaseCall{std::move(output), std::move(input), std::move(output_splits),
                                   std::move(input_splits), opts});
  }
  std::shared_ptr<Work> alltoall(std::vector<at::Tensor> outputs, std::vector<at::Tensor> inputs,
                                 const AllToAllOptions& opts = {}) {
    return submit(AlltoallCall{std::move(outputs), std::move(inputs), opts});
  }
  std::shared_ptr<Work> barrier(const BarrierOptions& opts = {}) {
    return submit(BarrierCall{opts});
  }
  std::shared_ptr<Work> send(at::Tensor tensor, int dst, int tag = 0,
                             const SendRecvOptions& opts = {}) {
    return submit(SendCall{std::move(tensor), dst, tag, opts});
  }
  std::shared_ptr<Work> recv(at::Tensor tensor, int src, int tag = 0,
                             const SendRecvOptions& opts = {}) {
    return submit(RecvCall{std::move(tensor), src, tag, opts});
  }
  std::shared_ptr<Work> recv_any_source(at::Tensor tensor, int tag = 0,
                                        const SendRecvOptions& opts = {}) {
    return submit(RecvAnySourceCall{std::move(tensor), tag, opts});
  }

  // Every operation above goes through here: what a backend implements.
  virtual std::shared_ptr<Work> submit(Call call) = 0;

  // A subgroup of `ranks` (global ranks of this group, any order; the subgroup's rank i is
  // ranks[i] after sorting). Every rank of this group must call it, in the same order relative
  // to other new_group calls; ranks not in the subgroup get nullptr. The subgroup has its own
  // connections, store prefix and sequence numbers.
  virtual std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks, const Options& opts) = 0;
  std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks) {
    return new_group(std::move(ranks), options());
  }

  // Fails every pending and later operation; never blocks long.
  virtual void abort() = 0;

  // A contiguous host tensor of `sizes` and `dtype` (uninitialized) that every local process of
  // the group maps (PyTorch's symmetric memory), so that an allreduce or a broadcast given such a
  // tensor on every rank, an allgather given such an output or a reduce-scatter such an input,
  // reads its peers' values where they lie instead of copying them through the ring or a system
  // call (Note [Symmetric memory] in comm/ring/symmetric_memory.cpp). Collective: every rank
  // calls it with the same sizes and dtype, in the same order relative to the group's
  // operations.
  // Where the backend cannot map its peers' memory (ranks on other hosts or in one process, a
  // peer it may not read, the NCCL backend) it is plain memory, and the operations are as for
  // any tensor. Freeing the tensor frees this rank's buffer once no operation uses it. (Defined
  // here, as every virtual of this class: a class with no out-of-line virtual has its vtable
  // and type info in every translation unit that uses it, which the fuzz targets rely on.)
  virtual at::Tensor symmetric_empty(const std::vector<int64_t>& sizes, at::ScalarType dtype) {
    return at::empty(sizes, at::TensorOptions().dtype(dtype));
  }
  // Whether `t` lies in a live buffer that symmetric_empty shared (false for plain memory).
  virtual bool is_symmetric(const at::Tensor& /*t*/) const { return false; }
};

// Creates the group: ranks exchange their addresses through `store` (under a prefix of its own)
// and connect. Blocks until every rank joined or opts.timeout passed (TimeoutError naming the
// ranks that did not arrive). Unknown backend names throw InvalidArgument listing the known ones.
std::shared_ptr<ProcessGroup> create_process_group(std::shared_ptr<Store> store, int rank, int size,
                                                   ProcessGroup::Options opts = {});

// Same, from an init_method URL (env://, tcp://host:port, file:///path; see rendezvous.h).
std::shared_ptr<ProcessGroup> create_process_group(const std::string& init_method, int rank = -1,
                                                   int size = -1, ProcessGroup::Options opts = {});

}  // namespace tdist::comm
