// The staged operations of RingProcessGroup (Note [Overlapped staging] in
// algorithms/overlapped_staging.h, Note [Windows] in algorithms/context.h): CUDA tensors through
// host memory window by window, each window's copies in queued while the one before runs, its
// results copied out as the algorithm finishes them.

#include <ATen/ATen.h>

#include <algorithm>

#include "tdist/comm/algorithms/allreduce_recursive_doubling.h"
#include "tdist/comm/algorithms/allreduce_ring.h"
#include "tdist/comm/algorithms/alltoall_pairwise.h"
#include "tdist/comm/algorithms/gather_scatter_direct.h"
#include "tdist/comm/algorithms/reduce_chain.h"
#include "tdist/comm/algorithms/reduce_scatter_ring.h"
#include "tdist/comm/ring/ring_process_group.h"
#include "tdist/comm/ring/staging.h"

namespace tdist::comm::detail {
namespace {

namespace algo = tdist::comm::algorithms;
using Value = Future::Value;

// A range of a tensor's elements (or bytes) [begin, begin + n).
at::Tensor slice(const at::Tensor& flat, size_t begin, size_t n) {
  return flat.narrow(0, static_cast<int64_t>(begin), static_cast<int64_t>(n));
}

// Bytes of a block of `bytes` that fall in [off, off + n).
size_t clipped(size_t bytes, size_t off, size_t n) {
  return std::min(bytes, off + n) - std::min(bytes, off);
}

// Runs stage(begin, n) for consecutive windows [begin, begin + n) of `count` units, `window` at a
// time, and run(staged, n) for each: the next window is staged (its copies in queued) while the
// current one runs, so at most two windows' host memory is in use (Note [Windows]).
template <typename Stage, typename Run>
void over_windows(size_t count, size_t window, std::shared_ptr<StagedTensors> first,
                  const Stage& stage, const Run& run) {
  std::shared_ptr<StagedTensors> now = std::move(first);
  algo::for_each_window(count, window, [&](size_t begin, size_t n) {
    const size_t after = begin + n;
    std::shared_ptr<StagedTensors> next;
    if (after < count) next = stage(after, std::min(window, count - after));
    run(*now, n);
    now->complete();
    now = std::move(next);  // this window's host memory is free for the one after
  });
}

}  // namespace

std::shared_ptr<Work> RingProcessGroup::allreduce_staged(const char* name,
                                                         const std::vector<at::Tensor>& ts,
                                                         const algo::ReduceSpec& rs, Millis timeout,
                                                         Fingerprint fp) {
  size_t count = 0;
  for (const auto& t : ts) count += static_cast<size_t>(t.numel());
  const AllreduceAlgo algorithm = allreduce_algorithm(count, rs.elem_size);
  if (algorithm == AllreduceAlgo::kHierarchical || algorithm == AllreduceAlgo::kSingleCopy ||
      !StagedTensors::wanted(ts, size_, staging_piece_bytes_)) {
    return nullptr;
  }
  // One ring (or recursive doubling) per window (Note [Windows]), each staged on its own: the
  // first window's copies in start now on the caller's stream, each next one's while the one
  // before runs, on a side stream after the point the caller's stream had reached at this call.
  // The ring sends each piece once it arrived, in the order it needs them; recursive doubling
  // exchanges the whole window at once, so it waits for all of it.
  // A staged halving-doubling runs the ring: the ring sends each piece as it arrives.
  const bool ring =
      algorithm == AllreduceAlgo::kRing || algorithm == AllreduceAlgo::kHalvingDoubling;
  const size_t window = algo::window_elems(window_bytes_, rs.elem_size);
  auto stage = [ts, rs, ring, piece = staging_piece_bytes_, size = size_, rank = rank_,
                issue = count > window ? StagedTensors::mark_issue(ts) : nullptr](size_t begin,
                                                                                  size_t n) {
    return std::make_shared<StagedTensors>(
        StagedTensors::in_and_out(element_range(ts, begin, begin + n)),
        ring ? algo::ring_allreduce_pieces(n, rs.elem_size, size, rank, piece)
             : ascending_pieces(0, n * rs.elem_size, piece),
        piece, begin == 0 ? nullptr : issue);
  };
  return enqueue(name, timeout, std::move(fp),
                 [ts, stage, count, window, rs, ring,
                  first = stage(0, std::min(window, count))](algo::Context& c) mutable {
                   over_windows(count, window, std::move(first), stage,
                                [&](StagedTensors& w, size_t n) {
                                  if (ring) {
                                    algo::allreduce_ring(c, w.data(), n, rs, &w);
                                    return;
                                  }
                                  const size_t bytes = n * rs.elem_size;
                                  w.await_arrival(0, bytes);
                                  algo::allreduce_recursive_doubling(c, w.data(), n, rs);
                                  w.finished(0, bytes);
                                });
                   return Value{ts};
                 });
}

std::shared_ptr<Work> RingProcessGroup::allgather_staged(const char* name, const at::Tensor& input,
                                                         const std::vector<at::Tensor>& outputs,
                                                         Value result, Millis timeout,
                                                         Fingerprint fp) {
  std::vector<at::Tensor> all = outputs;
  all.push_back(input);
  if (!StagedTensors::wanted(all, size_, staging_piece_bytes_)) return nullptr;
  const size_t block = input.nbytes();
  const size_t window = algo::block_window_bytes(window_bytes_, size_);
  std::vector<at::Tensor> outs;
  for (const at::Tensor& o : outputs) outs.push_back(flat_bytes(o));
  // A window: every rank's slice [off, off + n) of its block; this rank's slice is copied in from
  // the input, in pieces, and out to its own output like the others.
  auto stage = [outs, in = flat_bytes(input), piece = staging_piece_bytes_, rank = rank_,
                issue = block > window ? StagedTensors::mark_issue(all) : nullptr](size_t off,
                                                                                   size_t n) {
    std::vector<StagedTensors::Slot> slots;
    for (size_t i = 0; i < outs.size(); ++i) {
      slots.push_back(StagedTensors::Slot{
          static_cast<int>(i) == rank ? slice(in, off, n) : at::Tensor(), slice(outs[i], off, n)});
    }
    return std::make_shared<StagedTensors>(std::move(slots), ascending_pieces(rank * n, n, piece),
                                           piece, off == 0 ? nullptr : issue);
  };
  return enqueue(name, timeout, std::move(fp),
                 [this, stage, block, window, result,
                  first = stage(0, std::min(window, block))](algo::Context& c) mutable {
                   over_windows(block, window, std::move(first), stage,
                                [&](StagedTensors& w, size_t n) {
                                  std::vector<char*> blocks;
                                  for (int i = 0; i < size_; ++i)
                                    blocks.push_back(w.data() + i * n);
                                  allgather_blocks(c, blocks, n, &w);
                                  // Its pieces have arrived: they were sent, or their address was.
                                  w.finished_at(blocks[rank_], n);
                                });
                   return result;
                 });
}

std::shared_ptr<Work> RingProcessGroup::reduce_scatter_staged(const char* name,
                                                              const std::vector<at::Tensor>& inputs,
                                                              const at::Tensor& output,
                                                              const algo::ReduceSpec& rs,
                                                              Millis timeout, Fingerprint fp) {
  std::vector<at::Tensor> all = inputs;
  all.push_back(output);
  if (!StagedTensors::wanted(all, size_, staging_piece_bytes_)) return nullptr;
  const auto count = static_cast<size_t>(output.numel());
  const size_t window = algo::block_window_elems(window_bytes_, size_, rs.elem_size);
  // Every rank's block, whether the inputs are one tensor or one per rank.
  std::vector<at::Tensor> blocks;
  if (inputs.size() == 1) {
    blocks = inputs[0].reshape({-1}).chunk(size_);
  } else {
    for (const at::Tensor& t : inputs) blocks.push_back(t.reshape({-1}));
  }
  const at::Tensor out = output.reshape({-1});
  // A window: the slices [begin, begin + n) of every rank's block, copied in, then the output's,
  // copied out.
  auto stage = [blocks, out, rs, size = size_, rank = rank_, chunk = chunk_bytes_,
                piece = staging_piece_bytes_,
                issue = count > window ? StagedTensors::mark_issue(all) : nullptr](size_t begin,
                                                                                   size_t n) {
    std::vector<StagedTensors::Slot> slots;
    for (const at::Tensor& b : blocks) slots.push_back(StagedTensors::Slot{slice(b, begin, n), {}});
    slots.push_back(StagedTensors::Slot{at::Tensor(), slice(out, begin, n)});
    return std::make_shared<StagedTensors>(
        std::move(slots), algo::reduce_scatter_pieces(n, rs.elem_size, size, rank, chunk, piece),
        piece, begin == 0 ? nullptr : issue);
  };
  return enqueue(name, timeout, std::move(fp),
                 [this, stage, count, window, rs, output,
                  first = stage(0, std::min(window, count))](algo::Context& c) mutable {
                   over_windows(count, window, std::move(first), stage,
                                [&](StagedTensors& w, size_t n) {
                                  const size_t bytes = n * rs.elem_size;
                                  std::vector<const char*> ins;
                                  for (int i = 0; i < size_; ++i)
                                    ins.push_back(w.data() + i * bytes);
                                  char* result = w.data() + size_ * bytes;
                                  algo::reduce_scatter_ring(c, ins, result, n, rs, &w);
                                  w.finished_at(result, bytes);
                                });
                   return Value{output};
                 });
}

std::shared_ptr<Work> RingProcessGroup::broadcast_staged(const at::Tensor& tensor, int root,
                                                         Millis timeout, Fingerprint fp) {
  if (!StagedTensors::wanted({tensor}, size_, staging_piece_bytes_)) return nullptr;
  const size_t bytes = tensor.nbytes();
  // The root's window is copied in, the others' copied out as it lands.
  auto stage = [flat = flat_bytes(tensor), is_root = rank_ == root, piece = staging_piece_bytes_,
                issue = bytes > window_bytes_ ? StagedTensors::mark_issue({tensor}) : nullptr](
                   size_t off, size_t n) {
    const at::Tensor part = slice(flat, off, n);
    return std::make_shared<StagedTensors>(
        std::vector<StagedTensors::Slot>{is_root ? StagedTensors::Slot{part, {}}
                                                 : StagedTensors::Slot{{}, part}},
        is_root ? ascending_pieces(0, n, piece) : std::vector<algo::ByteRange>{}, piece,
        off == 0 ? nullptr : issue);
  };
  return enqueue("broadcast", timeout, std::move(fp),
                 [this, stage, bytes, root, tensor,
                  first = stage(0, std::min(window_bytes_, bytes))](algo::Context& c) mutable {
                   over_windows(bytes, window_bytes_, std::move(first), stage,
                                [&](StagedTensors& w, size_t n) {
                                  broadcast_bytes(c, w.data(), n, root, &w);
                                });
                   return Value{tensor};
                 });
}

std::shared_ptr<Work> RingProcessGroup::reduce_staged(const at::Tensor& tensor,
                                                      const algo::ReduceSpec& rs, int root,
                                                      Millis timeout, Fingerprint fp) {
  if (!StagedTensors::wanted({tensor}, size_, staging_piece_bytes_)) return nullptr;
  const auto count = static_cast<size_t>(tensor.numel());
  const size_t window = algo::window_elems(window_bytes_, rs.elem_size);
  // Every rank's window is copied in; the root's result is copied out (the others' tensors are
  // not written).
  auto stage = [flat = tensor.reshape({-1}), is_root = rank_ == root, rs,
                piece = staging_piece_bytes_,
                issue = count > window ? StagedTensors::mark_issue({tensor}) : nullptr](
                   size_t begin, size_t n) {
    const at::Tensor part = slice(flat, begin, n);
    return std::make_shared<StagedTensors>(
        std::vector<StagedTensors::Slot>{{part, is_root ? part : at::Tensor()}},
        ascending_pieces(0, n * rs.elem_size, piece), piece, begin == 0 ? nullptr : issue);
  };
  return enqueue("reduce", timeout, std::move(fp),
                 [stage, count, window, rs, root, tensor,
                  first = stage(0, std::min(window, count))](algo::Context& c) mutable {
                   over_windows(count, window, std::move(first), stage,
                                [&](StagedTensors& w, size_t n) {
                                  algo::reduce_chain(c, w.data(), w.data(), n, rs, root, &w);
                                });
                   return Value{tensor};
                 });
}

std::shared_ptr<Work> RingProcessGroup::gather_or_scatter_staged(
    bool gather, const at::Tensor& mine, const std::vector<at::Tensor>& theirs, int root,
    Value result, Millis timeout, Fingerprint fp) {
  std::vector<at::Tensor> all = theirs;
  all.push_back(mine);
  if (!StagedTensors::wanted(all, size_, staging_piece_bytes_)) return nullptr;
  const size_t block = mine.nbytes();
  const size_t window = algo::block_window_bytes(window_bytes_, size_);
  std::vector<at::Tensor> flat;
  for (const at::Tensor& t : theirs) flat.push_back(flat_bytes(t));
  // A window: the slice [off, off + n) of this rank's tensor (a gather's input, copied in; a
  // scatter's output, copied out); on the root also every rank's slice of the root's tensors
  // (copied out for a gather, in for a scatter), its own straight from or to its tensor.
  auto stage = [gather, flat, m = flat_bytes(mine), piece = staging_piece_bytes_, rank = rank_,
                root, size = size_,
                issue = block > window ? StagedTensors::mark_issue(all) : nullptr](size_t off,
                                                                                   size_t n) {
    const at::Tensor own = slice(m, off, n);
    std::vector<StagedTensors::Slot> slots;
    if (rank != root) {
      slots.push_back(gather ? StagedTensors::Slot{own, {}} : StagedTensors::Slot{{}, own});
    } else {
      for (size_t i = 0; i < flat.size(); ++i) {
        const at::Tensor other = slice(flat[i], off, n);
        const at::Tensor self = static_cast<int>(i) == root ? own : at::Tensor();
        slots.push_back(gather ? StagedTensors::Slot{self, other}
                               : StagedTensors::Slot{other, self});
      }
    }
    std::vector<algo::ByteRange> order;
    if (gather) {
      order = ascending_pieces(rank == root ? root * n : 0, n, piece);
    } else if (rank == root) {
      order = ascending_pieces(0, size * n, piece);
    }
    return std::make_shared<StagedTensors>(std::move(slots), std::move(order), piece,
                                           off == 0 ? nullptr : issue);
  };
  return enqueue(gather ? "gather" : "scatter", timeout, std::move(fp),
                 [this, gather, stage, block, window, root, result,
                  first = stage(0, std::min(window, block))](algo::Context& c) mutable {
                   over_windows(
                       block, window, std::move(first), stage, [&](StagedTensors& w, size_t n) {
                         std::vector<char*> blocks;
                         if (rank_ == root) {
                           for (int i = 0; i < size_; ++i) blocks.push_back(w.data() + i * n);
                         }
                         if (gather) {
                           algo::gather_direct(c, w.data(), blocks, n, root, &w);
                         } else {
                           const std::vector<const char*> sent(blocks.begin(), blocks.end());
                           algo::scatter_direct(c, sent, w.data(), n, root, &w);
                         }
                         if (rank_ != root) return;
                         // The root's own slice goes from its input to its output
                         // through host memory.
                         w.await_arrival(root * n, (root + 1) * n);
                         w.finished_at(blocks[root], n);
                       });
                   return result;
                 });
}

std::shared_ptr<Work> RingProcessGroup::alltoall_staged(
    const char* name, std::vector<at::Tensor> sends, std::vector<at::Tensor> recvs,
    const std::vector<at::Tensor>& all, Value result, Millis timeout, Fingerprint fp) {
  std::vector<size_t> send_bytes, recv_bytes;
  size_t longest = 0;
  for (int i = 0; i < size_; ++i) {
    send_bytes.push_back(sends[i].nbytes());
    recv_bytes.push_back(recvs[i].nbytes());
    longest = std::max({longest, send_bytes.back(), recv_bytes.back()});
  }
  // A window holds the slice [off, off + n) of every block sent and received (as far as the
  // block reaches): at most a window's bytes.
  const size_t window = algo::block_window_bytes(window_bytes_, 2 * size_);
  auto clip = [](const at::Tensor& b, size_t off, size_t n) {
    return slice(b, std::min(off, b.nbytes()), clipped(b.nbytes(), off, n));
  };
  // Host layout: the slices sent, in rank order (this rank's own also copied out, to its
  // received block), then the slices received from the others.
  auto stage = [sends, recvs, clip, piece = staging_piece_bytes_, rank = rank_,
                issue = longest > window ? StagedTensors::mark_issue(all) : nullptr](size_t off,
                                                                                     size_t n) {
    std::vector<StagedTensors::Slot> slots;
    size_t sent = 0;
    for (size_t p = 0; p < sends.size(); ++p) {
      slots.push_back(StagedTensors::Slot{clip(sends[p], off, n), static_cast<int>(p) == rank
                                                                      ? clip(recvs[p], off, n)
                                                                      : at::Tensor()});
      sent += slots.back().in.nbytes();
    }
    for (size_t p = 0; p < recvs.size(); ++p) {
      if (static_cast<int>(p) != rank)
        slots.push_back(StagedTensors::Slot{{}, clip(recvs[p], off, n)});
    }
    return std::make_shared<StagedTensors>(std::move(slots), ascending_pieces(0, sent, piece),
                                           piece, off == 0 ? nullptr : issue);
  };
  return enqueue(name, timeout, std::move(fp),
                 [this, stage, send_bytes, recv_bytes, longest, window, result,
                  first = stage(0, std::min(window, longest))](algo::Context& c) mutable {
                   algo::alltoall_lengths(c, send_bytes, recv_bytes);
                   size_t off = 0;  // the window's slice of the blocks: [off, off + n)
                   over_windows(longest, window, std::move(first), stage,
                                [&](StagedTensors& w, size_t n) {
                                  std::vector<const char*> send;
                                  std::vector<char*> recv(size_);
                                  std::vector<size_t> sb, rb;
                                  char* at = w.data();
                                  for (int p = 0; p < size_; ++p) {
                                    sb.push_back(clipped(send_bytes[p], off, n));
                                    rb.push_back(clipped(recv_bytes[p], off, n));
                                    if (p == rank_) recv[p] = at;  // its own slice, in place
                                    send.push_back(at);
                                    at += sb.back();
                                  }
                                  for (int p = 0; p < size_; ++p) {
                                    if (p == rank_) continue;
                                    recv[p] = at;
                                    at += rb[p];
                                  }
                                  algo::alltoall_blocks(c, send, sb, recv, rb, w);
                                  const auto own = static_cast<size_t>(recv[rank_] - w.data());
                                  w.await_arrival(own, own + sb[rank_]);
                                  w.finished_at(recv[rank_], sb[rank_]);
                                  off += n;
                                });
                   return result;
                 });
}

}  // namespace tdist::comm::detail
