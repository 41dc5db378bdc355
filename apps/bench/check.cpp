#include "apps/bench/check.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <vector>

namespace tdist::bench {

at::Tensor input_values(int rank, int64_t numel) {
  // One generator per rank, so that every rank can compute every other rank's input.
  at::Generator gen = at::detail::createCPUGenerator(0x7d15u + static_cast<uint64_t>(rank));
  return at::randint(1, 6, {numel}, gen, at::TensorOptions().dtype(at::kDouble));
}

at::Tensor expected_output(const std::string& op, comm::ReduceOp redop, at::ScalarType dtype,
                           int rank, int world, int root, int64_t count) {
  const int64_t block = count / world;
  auto reduced = [&](int64_t numel) {
    at::Tensor acc = input_values(0, numel);
    for (int r = 1; r < world; ++r) {
      const at::Tensor x = input_values(r, numel);
      switch (redop) {
        case comm::ReduceOp::PRODUCT:
          acc = acc * x;
          break;
        case comm::ReduceOp::MIN:
          acc = at::minimum(acc, x);
          break;
        case comm::ReduceOp::MAX:
          acc = at::maximum(acc, x);
          break;
        default:
          acc = acc + x;
      }
    }
    if (redop == comm::ReduceOp::AVG) acc = acc / world;
    return acc.to(dtype).to(at::kDouble);  // rounded as the result is
  };
  auto blocks_of = [&](auto block_of) {
    std::vector<at::Tensor> parts;
    for (int r = 0; r < world; ++r) parts.push_back(block_of(r));
    return at::cat(parts);
  };
  if (op == "allreduce" || (op == "reduce" && rank == root)) return reduced(count);
  if (op == "reduce") return input_values(rank, count);  // a non-root's input is unchanged
  if (op == "broadcast") return input_values(root, count);
  if (op == "allgather" || (op == "gather" && rank == root)) {
    return blocks_of([&](int r) { return input_values(r, block); });
  }
  if (op == "scatter") return input_values(root, block * world).narrow(0, rank * block, block);
  if (op == "reduce_scatter") return reduced(block * world).narrow(0, rank * block, block);
  if (op == "alltoall") {  // block `rank` of every rank's input
    return blocks_of(
        [&](int r) { return input_values(r, block * world).narrow(0, rank * block, block); });
  }
  return {};  // a gather's non-root, a barrier
}

int64_t count_wrong(const at::Tensor& got, const at::Tensor& want) {
  if (!want.defined()) return 0;
  if (got.numel() != want.numel()) return want.numel();
  const at::Tensor g = got.to(at::kCPU).to(at::kDouble).reshape({-1});
  return (at::abs(g - want) > 1e-3 * (at::abs(want) + 1)).sum().item<int64_t>();
}

}  // namespace tdist::bench
