// The operations of RingProcessGroup: argument checks (on the caller's thread, InvalidArgument),
// contiguous working buffers, and the algorithm each operation runs on the worker (staged CUDA
// tensors: ring_process_group_staged.cpp).

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "tdist/comm/algorithms/allgather_ring.h"
#include "tdist/comm/algorithms/allreduce_halving_doubling.h"
#include "tdist/comm/algorithms/allreduce_ring.h"
#include "tdist/comm/algorithms/allreduce_recursive_doubling.h"
#include "tdist/comm/algorithms/alltoall_pairwise.h"
#include "tdist/comm/algorithms/barrier_dissemination.h"
#include "tdist/comm/algorithms/broadcast_pipelined.h"
#include "tdist/comm/algorithms/gather_scatter_direct.h"
#include "tdist/comm/algorithms/reduce_chain.h"
#include "tdist/comm/algorithms/reduce_scatter_ring.h"
#include "tdist/comm/algorithms/single_copy.h"
#include "tdist/comm/ring/ring_process_group.h"
#include "tdist/comm/ring/staging.h"
#include "tdist/core/error.h"
#include "tdist/core/tensor_wire.h"

namespace tdist::comm::detail {
namespace {

namespace algo = tdist::comm::algorithms;
using Value = Future::Value;

void check_like(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* what,
                size_t index) {
  check_stageable(t, op, what);
  TDIST_CHECK_ARG(t.scalar_type() == ref.scalar_type(), op, ": ", what, "[", index, "] has dtype ",
                  t.scalar_type(), " but ", ref.scalar_type(), " is expected");
  TDIST_CHECK_ARG(t.sizes() == ref.sizes(), op, ": ", what, "[", index, "] has shape ", t.sizes(),
                  " but ", ref.sizes(), " is expected");
}

void check_count(size_t got, int expected, const char* op, const char* what) {
  TDIST_CHECK_ARG(got == static_cast<size_t>(expected), op, ": expected ", expected, " ", what,
                  " (one per rank), got ", got);
}

void check_root(int root, int size, const char* op) {
  TDIST_CHECK_ARG(root >= 0 && root < size, op, ": root ", root, " is not in [0, ", size, ")");
}

// A contiguous working view of a tensor in host memory: the tensor itself, or a contiguous copy of
// its values made now (snapshotting a non-contiguous input, resolving a conjugate or negative
// view, or staging a CUDA tensor: Note [Staging device tensors]) that write_back() copies into
// the original (copy_ honours the original's conjugate/negative bit).
struct Contig {
  at::Tensor orig;
  at::Tensor work;
  // An output's current values are not needed: every byte of it is written (host_output).
  enum Use { kRead, kWriteOnly };
  explicit Contig(const at::Tensor& t, Use use = kRead)
      : orig(t), work(use == kRead ? host_values(t) : host_output(t)) {}
  char* data() const { return static_cast<char*>(work.data_ptr()); }
  size_t bytes() const { return static_cast<size_t>(work.numel()) * work.element_size(); }
  void write_back() const {
    if (!work.is_same(orig)) orig.copy_(work);
  }
};

std::vector<Contig> contig_all(const std::vector<at::Tensor>& ts, Contig::Use use = Contig::kRead) {
  std::vector<Contig> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.emplace_back(t, use);
  return out;
}

// Empty unless `on` (TDIST_DEBUG=DETAIL): the check is all that reads it, and building it costs
// an allocation per shape on every operation.
Fingerprint fingerprint(bool on, const at::Tensor* t, int redop = -1, int root = -1,
                        std::vector<std::vector<int64_t>> shapes = {}) {
  Fingerprint f;
  if (!on) return f;
  if (t != nullptr) {
    f.dtype = static_cast<int32_t>(t->scalar_type());
    if (shapes.empty()) shapes.push_back(t->sizes().vec());
  }
  f.redop = redop;
  f.root = root;
  f.shapes = std::move(shapes);
  return f;
}

// A host tensor the algorithms can work in directly (host_values and host_output return it).
bool host_dense(const at::Tensor& t) {
  return t.device().is_cpu() && t.is_contiguous() && !t.is_conj() && !t.is_neg();
}

bool all_host_dense(const std::vector<at::Tensor>& ts) {
  return std::all_of(ts.begin(), ts.end(), host_dense);
}

// Note [Coalesced allreduce in place]: smaller tensors of a list are packed with their
// neighbours (one run of the algorithm costs a few microseconds, copying 32 KiB twice about as
// much), larger ones reduced where they lie.
constexpr size_t kCoalescedInPlaceBytes = 32 * 1024;

char* bytes_of(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

// ts and t, in one list.
std::vector<at::Tensor> with(std::vector<at::Tensor> ts, const at::Tensor& t) {
  ts.push_back(t);
  return ts;
}

// Row size in elements for alltoall splits along dim 0.
int64_t row_elems(const at::Tensor& t) {
  int64_t n = 1;
  for (int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

std::vector<int64_t> resolve_splits(std::vector<int64_t> splits, const at::Tensor& t, int size,
                                    const char* what) {
  TDIST_CHECK_ARG(t.dim() >= 1, "alltoall_base: the ", what,
                  " tensor must have at least one "
                  "dimension");
  if (splits.empty()) {
    TDIST_CHECK_ARG(t.size(0) % size == 0, "alltoall_base: the ", what,
                    " tensor's first dimension (", t.size(0),
                    ") is not divisible by the group size ", size);
    return std::vector<int64_t>(static_cast<size_t>(size), t.size(0) / size);
  }
  check_count(splits.size(), size, "alltoall_base", what);
  int64_t sum = 0;
  for (int64_t s : splits) {
    TDIST_CHECK_ARG(s >= 0, "alltoall_base: negative ", what, " split ", s);
    sum += s;
  }
  TDIST_CHECK_ARG(sum == t.size(0), "alltoall_base: the ", what, " splits add up to ", sum,
                  " rows but the tensor has ", t.size(0));
  return splits;
}

}  // namespace

algo::ReduceSpec RingProcessGroup::reduce_spec(const at::Tensor& t, ReduceOp op) const {
  return algo::ReduceSpec{t.scalar_type(), static_cast<size_t>(t.element_size()), op,
                          reduce_kernel(t.scalar_type(), op)};
}

RingProcessGroup::AllreduceAlgo RingProcessGroup::allreduce_algorithm(size_t count,
                                                                      size_t elem) const {
  bool small = count * elem <= small_allreduce_bytes_ || count < static_cast<size_t>(size_);
  using Choice = AllreduceChoice;  // parsed once, not compared as a name per call
  if (allreduce_algo_ == Choice::kRecursiveDoubling ||
      (allreduce_algo_ == Choice::kAuto && small)) {
    return AllreduceAlgo::kRecursiveDoubling;
  }
  if (allreduce_algo_ == Choice::kSingleCopy) {  // the ring where a peer cannot be read
    return single_copy_bytes_ != kNoSingleCopy ? AllreduceAlgo::kSingleCopy : AllreduceAlgo::kRing;
  }
  if (allreduce_algo_ == Choice::kHalvingDoubling) return AllreduceAlgo::kHalvingDoubling;
  if (hierarchy_ && allreduce_algo_ != Choice::kRing) return AllreduceAlgo::kHierarchical;
  // Note [Halving-doubling]: the ring's bytes in 2 log2 n rounds instead of 2(n-1) dependent
  // hops, at power-of-two worlds from 8, where the ring was measured slower than at 4 (issue
  // 46: 1,122 against 355 us at 1 MiB). At 2 both make two steps; at 4 (4 rounds against 6
  // hops) the ring stays until a machine with the cores times the two; elsewhere the ranks that
  // fold in would move the whole buffer twice more.
  if (allreduce_algo_ == Choice::kAuto && size_ >= 8 && (size_ & (size_ - 1)) == 0) {
    return AllreduceAlgo::kHalvingDoubling;
  }
  return AllreduceAlgo::kRing;
}

std::shared_ptr<SymmetricMemory::Segment> RingProcessGroup::agree_mapped(
    algo::Context& c, const char* data, size_t bytes, size_t op_bytes,
    std::vector<const char*>* buffers) const {
  // Note [Symmetric memory]: the same test on every rank (the operation's size, and whether the
  // group ever allocated), then the same answer from the swapped descriptors.
  if (!symmetric_ || !symmetric_->used() || op_bytes <= small_allreduce_bytes_) return nullptr;
  return symmetric_->agree(c, const_cast<char*>(data), bytes, buffers);
}

void RingProcessGroup::allreduce_flat(algo::Context& c, char* data, size_t count,
                                      const algo::ReduceSpec& rs) const {
  if (count >= static_cast<size_t>(size_)) {
    const size_t bytes = count * rs.elem_size;
    std::vector<const char*> buffers;
    if (auto held = agree_mapped(c, data, bytes, bytes, &buffers)) {
      algo::allreduce_mapped(c, buffers, count, rs);
      return;
    }
  }
  switch (allreduce_algorithm(count, rs.elem_size)) {
    case AllreduceAlgo::kRecursiveDoubling:
      algo::for_each_window(
          count, algo::window_elems(c.window_bytes, rs.elem_size), [&](size_t begin, size_t n) {
            algo::allreduce_recursive_doubling(c, data + begin * rs.elem_size, n, rs);
          });
      break;
    case AllreduceAlgo::kHalvingDoubling:
      algo::for_each_window(
          count, algo::window_elems(c.window_bytes, rs.elem_size), [&](size_t begin, size_t n) {
            algo::allreduce_halving_doubling(c, data + begin * rs.elem_size, n, rs);
          });
      break;
    case AllreduceAlgo::kHierarchical:
      algo::allreduce_hierarchical(c, *hierarchy_, data, count, rs);
      break;
    case AllreduceAlgo::kSingleCopy:
      algo::for_each_window(count, algo::window_elems(c.window_bytes, rs.elem_size),
                            [&](size_t begin, size_t n) {
                              algo::allreduce_single_copy(c, data + begin * rs.elem_size, n, rs);
                            });
      break;
    case AllreduceAlgo::kRing:
      algo::for_each_window(count, algo::window_elems(c.window_bytes, rs.elem_size),
                            [&](size_t begin, size_t n) {
                              algo::allreduce_ring(c, data + begin * rs.elem_size, n, rs);
                            });
      break;
  }
}

template <>
std::shared_ptr<Work> RingProcessGroup::start(AllreduceCall& c) {
  auto& tensor = c.tensor;
  const auto& opts = c.opts;
  check_stageable(tensor, "allreduce", "the tensor");
  auto rs = reduce_spec(tensor, opts.op);
  const auto count = static_cast<size_t>(tensor.numel());
  if (allreduce_algorithm(count, rs.elem_size) != AllreduceAlgo::kHierarchical &&
      StandIns::wanted({tensor}, size_, staging_piece_bytes_)) {
    StandIns s;
    auto inner = allreduce(s.updated(tensor), opts);
    return s.finish(inner, {tensor});
  }
  Fingerprint fp = fingerprint(debug_detail_, &tensor, int(opts.op));
  // Asked first so that a host tensor builds no list for allreduce_staged (Note [Small
  // operations] in op_queue.cpp).
  if (StagedTensors::wanted(tensor, size_, staging_piece_bytes_)) {
    if (auto staged = allreduce_staged("allreduce", {tensor}, rs, opts.timeout, fp)) return staged;
  }
  SmallArgs args;
  args.work = host_values(tensor);
  args.orig = std::move(tensor);
  args.rs = rs;
  return enqueue_small("allreduce", Kind::kAllreduce, opts.timeout, std::move(fp), std::move(args));
}

template <>
std::shared_ptr<Work> RingProcessGroup::start(AllreduceCoalescedCall& c) {
  auto& tensors = c.tensors;
  const auto& opts = c.opts;
  TDIST_CHECK_ARG(!tensors.empty(), "allreduce_coalesced: no tensors given");
  std::vector<std::vector<int64_t>> shapes;
  for (size_t i = 0; i < tensors.size(); ++i) {
    check_stageable(tensors[i], "allreduce_coalesced", "a tensor");
    TDIST_CHECK_ARG(tensors[i].scalar_type() == tensors[0].scalar_type(),
                    "allreduce_coalesced: tensor ", i, " has dtype ", tensors[i].scalar_type(),
                    " but tensor 0 has ", tensors[0].scalar_type());
    if (debug_detail_) shapes.push_back(tensors[i].sizes().vec());  // for the fingerprint only
  }
  auto rs = reduce_spec(tensors[0], opts.op);
  size_t count = 0;
  for (const auto& t : tensors) count += static_cast<size_t>(t.numel());
  if (allreduce_algorithm(count, rs.elem_size) != AllreduceAlgo::kHierarchical &&
      StandIns::wanted(tensors, size_, staging_piece_bytes_)) {
    StandIns s;
    auto inner = allreduce_coalesced(s.updated(tensors), opts);
    return s.finish(inner, tensors);
  }
  Fingerprint fp = fingerprint(debug_detail_, &tensors[0], int(opts.op), -1, shapes);
  if (auto staged = allreduce_staged("allreduce_coalesced", tensors, rs, opts.timeout, fp)) {
    return staged;
  }
  // Note [Coalesced allreduce in place]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A tensor of at least kCoalescedInPlaceBytes is reduced where it lies, by its own run of the
  // algorithm; each run of consecutive smaller tensors is packed into one flat buffer, reduced
  // and copied back. Before, every list was packed whole: two copies of every byte (DDP's
  // buckets of parameter gradients, reduced in place, were the case that paid for them). The
  // plan depends on the tensors' sizes alone, so every rank makes the same runs in the same
  // order whatever its tensors' layouts. A tensor reduced alone that is not host-dense is
  // reduced in a copy of its own, written back afterwards; so is every one when the bytes of any
  // two tensors of the list overlap, written back in list order (the old path's result where
  // tensors alias each other).
  struct Part {
    size_t begin, end;  // tensors [begin, end): one in place, or several packed
    at::Tensor flat;    // the packed values, or the tensor's working buffer
  };
  auto small = [&](size_t k) {
    return static_cast<size_t>(tensors[k].numel()) * rs.elem_size < kCoalescedInPlaceBytes;
  };
  std::vector<Part> parts;
  for (size_t i = 0; i < tensors.size();) {
    size_t j = i + 1;
    if (small(i)) {
      while (j < tensors.size() && small(j)) ++j;
    }
    parts.push_back({i, j, {}});
    i = j;
  }
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;  // [begin, end) of each host-dense tensor
  for (const auto& t : tensors) {
    if (!host_dense(t) || t.numel() == 0) continue;
    auto b = reinterpret_cast<uintptr_t>(t.data_ptr());
    spans.emplace_back(b, b + static_cast<uintptr_t>(t.numel()) * t.element_size());
  }
  std::sort(spans.begin(), spans.end());
  bool overlap = false;
  for (size_t k = 1; k < spans.size(); ++k)
    overlap = overlap || spans[k].first < spans[k - 1].second;
  for (auto& part : parts) {
    const at::Tensor& first = tensors[part.begin];
    if (part.end - part.begin == 1) {
      part.flat = !host_dense(first) ? host_values(first) : overlap ? first.clone() : first;
      continue;
    }
    std::vector<at::Tensor> pieces;
    for (size_t k = part.begin; k < part.end; ++k) {
      pieces.push_back(host_values(tensors[k]).reshape({-1}));
    }
    part.flat = at::cat(pieces);
  }
  return enqueue("allreduce_coalesced", opts.timeout, std::move(fp),
                 [this, tensors, parts = std::move(parts), rs](algo::Context& c) {
                   for (const auto& part : parts) {
                     allreduce_flat(c, static_cast<char*>(part.flat.data_ptr()),
                                    static_cast<size_t>(part.flat.numel()), rs);
                   }
                   for (const auto& part : parts) {
                     int64_t off = 0;
                     for (size_t k = part.begin; k < part.end; ++k) {
                       const at::Tensor& t = tensors[k];
                       if (part.flat.is_same(t)) continue;
                       t.copy_(part.flat.reshape({-1}).narrow(0, off, t.numel()).view(t.sizes()));
                       off += t.numel();
                     }
                   }
                   return tensors;
                 });
}

// Where each path wins on the 2-core machine (docs/perf-history.md, "Single-copy collectives"): a
// world-2 broadcast (the peer reads the root); with more ranks, the others all reading the root
// at once lost to the chain. Which allgather: Note [Which allgather] in ring_process_group.cpp.
void RingProcessGroup::broadcast_bytes(algo::Context& c, char* data, size_t bytes, int root,
                                       algo::Staging* staging) const {
  if (size_ == 2 && bytes >= single_copy_bytes_) {
    algo::broadcast_single_copy(c, data, bytes, root, staging);
  } else {
    algo::broadcast_pipelined(c, data, bytes, root, staging);
  }
}

void RingProcessGroup::broadcast_windows(algo::Context& c, char* data, size_t bytes,
                                         int root) const {
  std::vector<const char*> buffers;
  if (auto held = agree_mapped(c, data, bytes, bytes, &buffers)) {
    return algo::broadcast_mapped(c, buffers, bytes, root);
  }
  algo::for_each_window(bytes, window_bytes_,
                        [&](size_t off, size_t n) { broadcast_bytes(c, data + off, n, root); });
}

void RingProcessGroup::reduce_windows(algo::Context& c, char* data, size_t count,
                                      const algo::ReduceSpec& rs, int root) const {
  algo::for_each_window(count, algo::window_elems(window_bytes_, rs.elem_size),
                        [&](size_t begin, size_t n) {
                          char* p = data + begin * rs.elem_size;
                          algo::reduce_chain(c, p, p, n, rs, root);
                        });
}

void RingProcessGroup::allgather_blocks(algo::Context& c, const std::vector<char*>& blocks,
                                        size_t block_bytes, algo::Staging* staging) const {
  if (block_bytes >= allgather_single_copy_bytes_) {
    algo::allgather_single_copy(c, blocks, block_bytes, staging);
  } else {
    algo::allgather_ring(c, blocks, block_bytes, staging);
  }
}

void RingProcessGroup::allgather_windows(algo::Context& c, const std::vector<char*>& blocks,
                                         size_t block_bytes) const {
  // This rank's block is in place in its output by now: the peers read it there.
  std::vector<const char*> sources;
  if (auto held = agree_mapped(c, blocks[rank_], block_bytes, block_bytes * size_, &sources)) {
    return algo::allgather_mapped(c, sources, blocks, block_bytes);
  }
  const size_t window = algo::block_window_bytes(window_bytes_, size_);
  if (block_bytes <= window) return allgather_blocks(c, blocks, block_bytes);  // no slice list
  std::vector<char*> slice(blocks.size());
  algo::for_each_window(block_bytes, algo::block_window_bytes(window_bytes_, size_),
                        [&](size_t off, size_t n) {
                          for (size_t i = 0; i < blocks.size(); ++i) slice[i] = blocks[i] + off;
                          allgather_blocks(c, slice, n);
                        });
}

namespace {

// What a reduce-scatter tells its peers of its input (RingProcessGroup::agree_mapped): the start
// of its blocks when they lie one after another and the output is elsewhere or this rank's own
// block (which no peer reads); else null, so that every rank takes the ring.
const char* mappable_input(const std::vector<const char*>& blocks, size_t block_bytes,
                           const char* output, int rank) {
  const char* begin = blocks.front();
  for (size_t i = 1; i < blocks.size(); ++i) {
    if (blocks[i] != begin + i * block_bytes) return nullptr;
  }
  const char* end = begin + blocks.size() * block_bytes;
  const bool apart = output + block_bytes <= begin || end <= output;
  return apart || output == blocks[rank] ? begin : nullptr;
}

}  // namespace

void RingProcessGroup::reduce_scatter_windows(algo::Context& c,
                                              const std::vector<const char*>& blocks, char* output,
                                              size_t count, const algo::ReduceSpec& rs) const {
  const size_t block_bytes = count * rs.elem_size;
  std::vector<const char*> inputs;
  const size_t op_bytes = block_bytes * blocks.size();
  if (auto held = agree_mapped(c, mappable_input(blocks, block_bytes, output, rank_), op_bytes,
                               op_bytes, &inputs)) {
    return algo::reduce_scatter_mapped(c, inputs, output, count, rs);
  }
  const size_t window = algo::block_window_elems(window_bytes_, size_, rs.elem_size);
  if (count <= window) return algo::reduce_scatter_ring(c, blocks, output, count, rs);
  std::vector<const char*> slice(blocks.size());
  algo::for_each_window(count, window, [&](size_t begin, size_t n) {
    const size_t off = begin * rs.elem_size;
    for (size_t i = 0; i < blocks.size(); ++i) slice[i] = blocks[i] + off;
    algo::reduce_scatter_ring(c, slice, output + off, n, rs);
  });
}

// Note [Small operations] in op_queue.cpp: the block lists are the group's own
// (blocks_, in_blocks_, of size_ capacity), and the result one tensor (no list) or the caller's.
Future::Result RingProcessGroup::run_small(algo::Context& c, Kind kind, SmallArgs& a) {
  switch (kind) {
    case Kind::kAllreduce:
      allreduce_flat(c, bytes_of(a.work), static_cast<size_t>(a.work.numel()), a.rs);
      break;
    case Kind::kBroadcast:
      broadcast_windows(c, bytes_of(a.work), a.work.nbytes(), a.root);
      if (rank_ == a.root) return std::move(a.orig);  // nothing written
      break;
    case Kind::kAllgatherInto:
    case Kind::kAllgatherList: {
      const size_t b = a.in.nbytes();
      blocks_.clear();
      for (int i = 0; i < size_; ++i) {
        blocks_.push_back(kind == Kind::kAllgatherList ? bytes_of(a.list[i])
                                                       : bytes_of(a.work) + i * b);
      }
      if (b > 0 && blocks_[rank_] != bytes_of(a.in)) {  // else in place already
        std::memmove(blocks_[rank_], bytes_of(a.in), b);
      }
      allgather_windows(c, blocks_, b);
      if (kind == Kind::kAllgatherList) return std::move(a.list);  // written in place
      break;
    }
    case Kind::kReduceScatterTensor:
    case Kind::kReduceScatterList: {
      const size_t b = a.work.nbytes();
      in_blocks_.clear();
      for (int i = 0; i < size_; ++i) {
        in_blocks_.push_back(kind == Kind::kReduceScatterList ? bytes_of(a.list[i])
                                                              : bytes_of(a.in) + i * b);
      }
      reduce_scatter_windows(c, in_blocks_, bytes_of(a.work), a.work.numel(), a.rs);
      break;
    }
    case Kind::kRun:
      TDIST_CHECK(false, "run_small called for an operation with a Run");
  }
  if (!a.work.is_same(a.orig)) a.orig.copy_(a.work);
  return std::move(a.orig);
}

template <>
std::shared_ptr<Work> RingProcessGroup::start(BroadcastCall& c) {
  auto& tensor = c.tensor;
  const auto& opts = c.opts;
  check_stageable(tensor, "broadcast", "the tensor");
  check_root(opts.root, size_, "broadcast");
  const int root = opts.root;
  if (StandIns::wanted({tensor}, size_, staging_piece_bytes_)) {
    StandIns s;
    auto inner = broadcast(rank_ == root ? s.read(tensor) : s.written(tensor), opts);
    return s.finish(inner, {tensor});
  }
  Fingerprint fp = fingerprint(debug_detail_, &tensor, -1, root);
  if (auto staged = broadcast_staged(tensor, root, opts.timeout, fp)) return staged;
  SmallArgs args;
  args.work = rank_ == root ? host_values(tensor) : host_output(tensor);
  args.orig = std::move(tensor);
  args.root = root;
  return enqueue_small("broadcast", Kind::kBroadcast, opts.timeout, std::move(fp), std::move(args));
}

template <>
std::shared_ptr<Work> RingProcessGroup::start(ReduceCall& c) {
  auto& tensor = c.tensor;
  const auto& opts = c.opts;
  check_stageable(tensor, "reduce", "the tensor");
  check_root(opts.root, size_, "reduce");
  auto rs = reduce_spec(tensor, opts.op);
  const int root = opts.root;
  if (StandIns::wanted({tensor}, size_, staging_piece_bytes_)) {
    StandIns s;
    auto inner = reduce(rank_ == root ? s.updated(tensor) : s.read(tensor), opts);
    return s.finish(inner, {tensor});
  }
  Fingerprint fp = fingerprint(debug_detail_, &tensor, int(opts.op), root);
  if (auto staged = reduce_staged(tensor, rs, root, opts.timeout, fp)) return staged;
  Contig buf(tensor);
  return enqueue("reduce", opts.timeout, std::move(fp), [this, buf, rs, root](algo::Context& c) {
    reduce_windows(c, buf.data(), buf.work.numel(), rs, root);
    if (rank_ == root) buf.write_back();
    return Value{buf.orig};
  });
}

template <>
std::shared_ptr<Work> RingProcessGroup::start(AllgatherCall& c) {
  auto& outputs = c.outputs;
  auto& input = c.input;
  const auto& opts = c.opts;
  check_stageable(input, "allgather", "the input");
  check_count(outputs.size(), size_, "allgather", "output tensors");
  for (size_t i = 0; i < outputs.size(); ++i)
    check_like(outputs[i], input, "allgather", "outputs", i);
  if (StagedTensors::may_stage(input)) {  // else neither builds its list
    if (StandIns::wanted(with(outputs, input), size_, staging_piece_bytes_)) {
      StandIns s;
      auto inner = allgather(s.written(outputs), s.read(input), opts);
      return s.finish(inner, outputs);
    }
    if (auto staged = allgather_staged("allgather", input, outputs, outputs, opts.timeout,
                                       fingerprint(debug_detail_, &input))) {
      return staged;
    }
  }
  if (all_host_dense(outputs)) {
    SmallArgs args;
    args.in = host_values(input);
    args.list = std::move(outputs);
    return enqueue_small("allgather", Kind::kAllgatherList, opts.timeout,
                         fingerprint(debug_detail_, &input), std::move(args));
  }
  Contig in(input);
  auto outs = contig_all(outputs, Contig::kWriteOnly);
  return enqueue("allgather", opts.timeout, fingerprint(debug_detail_, &input),
                 [this, in, outs, outputs](algo::Context& c) {
                   std::vector<char*> blocks;
                   for (const auto& o : outs) blocks.push_back(o.data());
                   if (in.bytes() > 0) std::memmove(blocks[rank_], in.data(), in.bytes());
                   allgather_windows(c, blocks, in.bytes());
                   for (const auto& o : outs) o.write_back();
                   return outputs;
                 });
}

template <>
std::shared_ptr<Work> RingProcessGroup::start(AllgatherIntoTensorCall& c) {
  auto& output = c.output;
  auto& input = c.input;
  const auto& opts = c.opts;
  check_stageable(input, "allgather_into_tensor", "the input");
  check_stageable(output, "allgather_into_tensor", "the output");
  TDIST_CHECK_ARG(output.scalar_type() == input.scalar_type(),
                  "allgather_into_tensor: output dtype ", output.scalar_type(),
                  " differs from input dtype ", input.scalar_type());
  TDIST_CHECK_ARG(output.numel() == input.numel() * size_, "allgather_into_tensor: the output has ",
                  output.numel(), " elements but ", size_, " x ", input.numel(), " are needed");
  if (StagedTensors::may_stage(output)) {  // else neither builds its list
    if (StandIns::wanted({output, input}, size_, staging_piece_bytes_)) {
      StandIns s;
      auto inner = allgather_into_tensor(s.written(output), s.read(input), opts);
      return s.finish(inner, {output});
    }
    // (Its blocks are views of the output only if it is contiguous.)
    if (output.is_contiguous()) {
      if (auto staged =
              allgather_staged("allgather_into_tensor", input, output.reshape({-1}).chunk(size_),
                               Value{output}, opts.timeout, fingerprint(debug_detail_, &input))) {
        return staged;
      }
    }
  }
  SmallArgs args;
  args.in = host_values(input);
  args.work = host_output(output);
  args.orig = std::move(output);
  return enqueue_small("allgather_into_tensor", Kind::kAllgatherInto, opts.timeout,
                       fingerprint(debug_detail_, &input), std::move(args));
}

template <>
std::shared_ptr<Work> RingProcessGroup::start(GatherCall& c) {
  auto& outputs = c.outputs;
  auto& input = c.input;
  const auto& opts = c.opts;
  check_stageable(input, "gather", "the input");
  check_root(opts.root, size_, "gather");
  const int root = opts.root;
  if (rank_ == root) {
    check_count(outputs.size(), size_, "gather", "output tensors on the root");
    for (size_t i = 0; i < outputs.size(); ++i)
      check_like(outputs[i], input, "gather", "outputs", i);
  } else {
    TDIST_CHECK_ARG(outputs.empty(), "gather: only the root (rank ", root,
                    ") passes output tensors; rank ", rank_, " passed ", outputs.size());
  }
  if (StandIns::wanted(with(outputs, input), size_, staging_piece_bytes_)) {
    StandIns s;
    auto inner = gather(s.written(outputs), s.read(input), opts);
    return s.finish(inner, outputs);
  }
  Fingerprint fp = fingerprint(debug_detail_, &input, -1, root);
  if (auto staged =
          gather_or_scatter_staged(true, input, outputs, root, outputs, opts.timeout, fp)) {
    return staged;
  }
  Contig in(input);
  auto outs = contig_all(outputs, Contig::kWriteOnly);
  return enqueue("gather", opts.timeout, std::move(fp),
                 [this, in, outs, outputs, root](algo::Context& c) {
                   std::vector<char*> blocks;
                   for (const auto& o : outs) blocks.push_back(o.data());
                   if (rank_ == root && in.bytes() > 0)
                     std::memmove(blocks[root], in.data(), in.bytes());
                   algo::gather_direct(c, in.data(), blocks, in.bytes(), root);
                   for (const auto& o : outs) o.write_back();
                   return outputs;
                 });
}

template <>
std::shared_ptr<Work> RingProcessGroup::start(ScatterCall& c) {
  auto& output = c.output;
  auto& inputs = c.inputs;
  const auto& opts = c.opts;
  check_stageable(output, "scatter", "the output");
  check_root(opts.root, size_, "scatter");
  const int root = opts.root;
  if (rank_ == root) {
    check_count(inputs.size(), size_, "scatter", "input tensors on the root");
    for (size_t i = 0; i < inputs.size(); ++i)
      check_like(inputs[i], output, "scatter", "inputs", i);
  } else {
    TDIST_CHECK_ARG(inputs.empty(), "scatter: only the root (rank ", root,
                    ") passes input tensors; rank ", rank_, " passed ", inputs.size());
  }
  if (StandIns::wanted(with(inputs, output), size_, staging_piece_bytes_)) {
    StandIns s;
    auto inner = scatter(s.written(output), s.read(inputs), opts);
    return s.finish(inner, {output});
  }
  Fingerprint fp = fingerprint(debug_detail_, &output, -1, root);
  if (auto staged =
          gather_or_scatter_staged(false, output, inputs, root, Value{output}, opts.timeout, fp)) {
    return staged;
  }
  Contig out(output, Contig::kWriteOnly);
  auto ins = contig_all(inputs);
  return enqueue("scatter", opts.timeout, std::move(fp), [this, out, ins, root](algo::Context& c) {
    std::vector<const char*> blocks;
    for (const auto& i : ins) blocks.push_back(i.data());
    if (rank_ == root && out.bytes() > 0) std::memmove(out.data(), blocks[root], out.bytes());
    algo::scatter_direct(c, blocks, out.data(), out.bytes(), root);
    out.write_back();
    return Value{out.orig};
  });
}

template <>
std::shared_ptr<Work> RingProcessGroup::start(ReduceScatterCall& c) {
  auto& output = c.output;
  auto& inputs = c.inputs;
  const auto& opts = c.opts;
  check_stageable(output, "reduce_scatter", "the output");
  check_count(inputs.size(), size_, "reduce_scatter", "input tensors");
  for (size_t i = 0; i < inputs.size(); ++i)
    check_like(inputs[i], output, "reduce_scatter", "inputs", i);
  const bool may_stage = StagedTensors::may_stage(output);  // else neither builds its list
  if (may_stage && StandIns::wanted(with(inputs, output), size_, staging_piece_bytes_)) {
    StandIns s;
    auto inner = reduce_scatter(s.written(output), s.read(inputs), opts);
    return s.finish(inner, {output});
  }
  auto rs = reduce_spec(output, opts.op);
  Fingerprint fp = fingerprint(debug_detail_, &output, int(opts.op));
  if (may_stage) {
    if (auto staged =
            reduce_scatter_staged("reduce_scatter", inputs, output, rs, opts.timeout, fp)) {
      return staged;
    }
  }
  if (all_host_dense(inputs)) {
    SmallArgs args;
    args.work = host_output(output);
    args.orig = std::move(output);
    args.list = std::move(inputs);
    args.rs = rs;
    return enqueue_small("reduce_scatter", Kind::kReduceScatterList, opts.timeout, std::move(fp),
                         std::move(args));
  }
  Contig out(output, Contig::kWriteOnly);
  auto ins = contig_all(inputs);
  return enqueue("reduce_scatter", opts.timeout, std::move(fp),
                 [this, out, ins, rs](algo::Context& c) {
                   std::vector<const char*> blocks;
                   for (const auto& i : ins) blocks.push_back(i.data());
                   reduce_scatter_windows(c, blocks, out.data(), out.work.numel(), rs);
                   out.write_back();
                   return Value{out.orig};
                 });
}

template <>
std::shared_ptr<Work> RingProcessGroup::start(ReduceScatterTensorCall& c) {
  auto& output = c.output;
  auto& input = c.input;
  const auto& opts = c.opts;
  check_stageable(output, "reduce_scatter_tensor", "the output");
  check_stageable(input, "reduce_scatter_tensor", "the input");
  TDIST_CHECK_ARG(output.scalar_type() == input.scalar_type(),
                  "reduce_scatter_tensor: output dtype ", output.scalar_type(),
                  " differs from input dtype ", input.scalar_type());
  TDIST_CHECK_ARG(input.numel() == output.numel() * size_, "reduce_scatter_tensor: the input has ",
                  input.numel(), " elements but ", size_, " x ", output.numel(), " are needed");
  const bool may_stage = StagedTensors::may_stage(output);  // else neither builds its list
  if (may_stage && StandIns::wanted({output, input}, size_, staging_piece_bytes_)) {
    StandIns s;
    auto inner = reduce_scatter_tensor(s.written(output), s.read(input), opts);
    return s.finish(inner, {output});
  }
  auto rs = reduce_spec(output, opts.op);
  Fingerprint fp = fingerprint(debug_detail_, &output, int(opts.op));
  if (may_stage) {
    if (auto staged =
            reduce_scatter_staged("reduce_scatter_tensor", {input}, output, rs, opts.timeout, fp)) {
      return staged;
    }
  }
  SmallArgs args;
  args.work = host_output(output);
  args.orig = std::move(output);
  args.in = host_values(input);
  args.rs = rs;
  return enqueue_small("reduce_scatter_tensor", Kind::kReduceScatterTensor, opts.timeout,
                       std::move(fp), std::move(args));
}

template <>
std::shared_ptr<Work> RingProcessGroup::start(AlltoallBaseCall& c) {
  auto& output = c.output;
  auto& input = c.input;
  auto& output_splits = c.output_splits;
  auto& input_splits = c.input_splits;
  const auto& opts = c.opts;
  check_stageable(output, "alltoall_base", "the output");
  check_stageable(input, "alltoall_base", "the input");
  TDIST_CHECK_ARG(output.scalar_type() == input.scalar_type(), "alltoall_base: output dtype ",
                  output.scalar_type(), " differs from input dtype ", input.scalar_type());
  if (StandIns::wanted({input, output}, size_, staging_piece_bytes_)) {
    StandIns s;
    auto inner = alltoall_base(s.written(output), s.read(input), std::move(output_splits),
                               std::move(input_splits), opts);
    return s.finish(inner, {output});
  }
  const bool equal = output_splits.empty() && input_splits.empty();
  auto in_splits = resolve_splits(std::move(input_splits), input, size_, "input");
  auto out_splits = resolve_splits(std::move(output_splits), output, size_, "output");
  const size_t es = input.element_size();
  std::vector<size_t> send_bytes, recv_bytes, send_off, recv_off;
  size_t so = 0, ro = 0;
  for (int i = 0; i < size_; ++i) {
    send_off.push_back(so);
    recv_off.push_back(ro);
    send_bytes.push_back(static_cast<size_t>(in_splits[i] * row_elems(input)) * es);
    recv_bytes.push_back(static_cast<size_t>(out_splits[i] * row_elems(output)) * es);
    so += send_bytes.back();
    ro += recv_bytes.back();
  }
  TDIST_CHECK_ARG(send_bytes[rank_] == recv_bytes[rank_], "alltoall_base: this rank sends ",
                  send_bytes[rank_], " bytes to itself but expects ", recv_bytes[rank_]);
  // With explicit splits the shapes legitimately differ between ranks: compare the dtype only.
  auto fp =
      equal ? fingerprint(debug_detail_, &input) : fingerprint(debug_detail_, &input, -1, -1, {{}});
  if (StagedTensors::wanted({input, output}, size_, staging_piece_bytes_)) {
    std::vector<at::Tensor> sends, recvs;
    const at::Tensor in_bytes = flat_bytes(input), out_bytes = flat_bytes(output);
    for (int i = 0; i < size_; ++i) {
      sends.push_back(in_bytes.narrow(0, static_cast<int64_t>(send_off[i]),
                                      static_cast<int64_t>(send_bytes[i])));
      recvs.push_back(out_bytes.narrow(0, static_cast<int64_t>(recv_off[i]),
                                       static_cast<int64_t>(recv_bytes[i])));
    }
    return alltoall_staged("alltoall_base", std::move(sends), std::move(recvs), {input, output},
                           Value{output}, opts.timeout, std::move(fp));
  }
  Contig in(input);
  Contig out(output, Contig::kWriteOnly);
  return enqueue("alltoall_base", opts.timeout, fp,
                 [in, out, send_bytes, recv_bytes, send_off, recv_off](algo::Context& c) {
                   std::vector<const char*> send;
                   std::vector<char*> recv;
                   for (size_t i = 0; i < send_bytes.size(); ++i) {
                     send.push_back(in.data() + send_off[i]);
                     recv.push_back(out.data() + recv_off[i]);
                   }
                   algo::alltoall_pairwise(c, send, send_bytes, recv, recv_bytes);
                   out.write_back();
                   return Value{out.orig};
                 });
}

template <>
std::shared_ptr<Work> RingProcessGroup::start(AlltoallCall& c) {
  auto& outputs = c.outputs;
  auto& inputs = c.inputs;
  const auto& opts = c.opts;
  check_count(outputs.size(), size_, "alltoall", "output tensors");
  check_count(inputs.size(), size_, "alltoall", "input tensors");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_stageable(inputs[i], "alltoall", "an input");
    check_stageable(outputs[i], "alltoall", "an output");
    TDIST_CHECK_ARG(inputs[i].scalar_type() == inputs[0].scalar_type() &&
                        outputs[i].scalar_type() == inputs[0].scalar_type(),
                    "alltoall: every input and output must have dtype ", inputs[0].scalar_type());
  }
  TDIST_CHECK_ARG(inputs[rank_].numel() == outputs[rank_].numel(), "alltoall: inputs[", rank_,
                  "] has ", inputs[rank_].numel(), " elements but outputs[", rank_, "] has ",
                  outputs[rank_].numel());
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  if (StandIns::wanted(all, size_, staging_piece_bytes_)) {
    StandIns s;
    auto inner = alltoall(s.written(outputs), s.read(inputs), opts);
    return s.finish(inner, outputs);
  }
  Fingerprint fp = fingerprint(debug_detail_, &inputs[0], -1, -1, {{}});
  if (StagedTensors::wanted(all, size_, staging_piece_bytes_)) {
    std::vector<at::Tensor> sends, recvs;
    for (int i = 0; i < size_; ++i) {
      sends.push_back(flat_bytes(inputs[i]));
      recvs.push_back(flat_bytes(outputs[i]));
    }
    return alltoall_staged("alltoall", std::move(sends), std::move(recvs), all, Value{outputs},
                           opts.timeout, std::move(fp));
  }
  auto ins = contig_all(inputs);
  auto outs = contig_all(outputs, Contig::kWriteOnly);
  return enqueue("alltoall", opts.timeout, fp, [ins, outs, outputs](algo::Context& c) {
    std::vector<const char*> send;
    std::vector<char*> recv;
    std::vector<size_t> send_bytes, recv_bytes;
    for (size_t i = 0; i < ins.size(); ++i) {
      send.push_back(ins[i].data());
      send_bytes.push_back(ins[i].bytes());
      recv.push_back(outs[i].data());
      recv_bytes.push_back(outs[i].bytes());
    }
    algo::alltoall_pairwise(c, send, send_bytes, recv, recv_bytes);
    for (const auto& o : outs) o.write_back();
    return outputs;
  });
}

template <>
std::shared_ptr<Work> RingProcessGroup::start(BarrierCall& c) {
  const auto& opts = c.opts;
  return enqueue("barrier", opts.timeout, fingerprint(debug_detail_, nullptr, -1, -1, {}),
                 [](algo::Context& c) {
                   algo::barrier_dissemination(c);
                   return Value{};
                 });
}

// Sends and receives go to the P2PEngine on their own channel (post_p2p).
template <>
std::shared_ptr<Work> RingProcessGroup::start(SendCall& c) {
  return post_p2p(true, std::move(c.tensor), c.dst, c.tag, c.opts.timeout);
}

template <>
std::shared_ptr<Work> RingProcessGroup::start(RecvCall& c) {
  TDIST_CHECK_ARG(c.src >= 0 && c.src < size_, "recv: source rank ", c.src, " is not in [0, ",
                  size_, ")");
  return post_p2p(false, std::move(c.tensor), c.src, c.tag, c.opts.timeout);
}

template <>
std::shared_ptr<Work> RingProcessGroup::start(RecvAnySourceCall& c) {
  return post_p2p(false, std::move(c.tensor), -1, c.tag, c.opts.timeout);
}

// After every start(): each Call's (Note [One operation table]).
std::shared_ptr<Work> RingProcessGroup::submit(Call call) {
  return std::visit([this](auto& c) { return start(c); }, call);
}

}  // namespace tdist::comm::detail
