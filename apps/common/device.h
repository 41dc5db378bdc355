#pragma once
// The --device flag of tdist-train and tdist-bench: "cpu", "cuda" or "auto".
//
// libtorch finds CUDA only when libtorch_cuda is loaded, and it decides once, at the first
// question anyone asks (at::detail::getCUDAHooks()). The apps do not link libtorch_cuda (it
// would double the start-up time of every CPU run); resolve_device() loads it for "cuda" and
// "auto" and must therefore run before anything else touches libtorch (torch::manual_seed asks).
// Not thread safe; call once, early in main.

#include <c10/core/Device.h>

#include <string>

namespace tdist::apps {

// Loads libtorch_cuda (once) and reports whether a GPU is visible; `why` (when not null) gets a
// sentence on why not: the library is missing or failed to load, or no device is visible.
bool cuda_available(std::string* why = nullptr);

// The device `choice` ("cpu", "cuda", "auto") names for this process: cuda is GPU LOCAL_RANK
// (the launcher's local rank: tdist-run's and torchrun's LOCAL_RANK, Slurm's SLURM_LOCALID, Open
// MPI's OMPI_COMM_WORLD_LOCAL_RANK; 0 when not launched), made the current CUDA device; auto is
// cuda when a GPU is visible, else cpu. Throws InvalidArgument naming `flag` for an unknown
// choice, for cuda without a visible GPU, and for a local rank without a GPU of its own unless
// `share_gpus`: then local rank r takes GPU r % count, for process groups that stage CUDA tensors
// through host memory (NCCL refuses two ranks on one GPU).
c10::Device resolve_device(const std::string& flag, const std::string& choice,
                           bool share_gpus = false);

}  // namespace tdist::apps
