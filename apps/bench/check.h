#pragma once
// What tdist-bench collective puts in and what it expects out, in nccl-tests' way: every element
// of every rank's input is drawn from a generator seeded with the rank, so each value depends on
// the rank and on the element's position; a block that lands at the wrong offset, is reduced from
// the wrong piece, or comes from the wrong rank differs from the expected result in most of its
// elements (rather than not at all, as with inputs that repeat along the buffer).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "tdist/comm/types.h"

namespace tdist::bench {

// Rank `rank`'s input of `numel` elements, as doubles: integers 1 to 5, so that every reduction of
// up to eight ranks is exact in every dtype the benchmark takes.
at::Tensor input_values(int rank, int64_t numel);

// What rank `rank` of `world` must hold after `op` ("allreduce", "broadcast", "reduce",
// "allgather", "gather", "scatter", "reduce_scatter", "alltoall"; `count` elements as tdist-bench
// collective sizes them: each rank's buffer, or the whole gathered or scattered one) with `redop`
// in `dtype`, as doubles; undefined where that rank holds no result (a gather's or a barrier's
// non-root). The checked tensor is the op's output: the buffer for allreduce, broadcast and
// reduce, the gathered buffer for allgather and gather, the rank's block for reduce_scatter and
// scatter, the received blocks for alltoall.
at::Tensor expected_output(const std::string& op, comm::ReduceOp redop, at::ScalarType dtype,
                           int rank, int world, int root, int64_t count);

// Elements of `got` (any device and dtype) that differ from `want` beyond rounding.
int64_t count_wrong(const at::Tensor& got, const at::Tensor& want);

}  // namespace tdist::bench
