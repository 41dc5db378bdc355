#pragma once
// Tensors on other devices through a CPU backend (Note [Staging device tensors]).
//
// Note [Staging device tensors]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The ring backend serves CUDA tensors as well as CPU ones, so every operation works on GPUs
// without NCCL, and with several ranks sharing one GPU (which NCCL refuses). An operation copies
// each CUDA tensor into host memory on the caller's thread when it is issued (host_values: a
// blocking copy on the caller's current stream, so every kernel queued before the call that
// wrote the tensor is done first), runs on the host copies, and copies the results back into the
// caller's tensors (Contig::write_back in ring_process_group_ops.cpp, a blocking copy) before the
// Work completes. The Work's completion therefore means the results are on the device: a caller
// that waits on it may use them from any stream. Host copies of CUDA tensors are pinned, from
// PyTorch's caching host allocator, so the memory of one step is reused by the next.
// The ranks need not agree on devices: a CPU tensor on one rank meets a CUDA tensor on another.

#include <ATen/core/Tensor.h>

namespace tdist::comm::detail {

// Throws InvalidArgument (naming `op` and `what`) unless `t` is a defined dense tensor on the CPU
// or a CUDA device.
void check_stageable(const at::Tensor& t, const char* op, const char* what);

// A contiguous CPU tensor with t's values (conjugate and negative views resolved): t itself when
// it already is one, else a copy (pinned host memory for a CUDA tensor).
at::Tensor host_values(const at::Tensor& t);

}  // namespace tdist::comm::detail
