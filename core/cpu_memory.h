#pragma once
// Counting the bytes of CPU tensors: a wrapper around libtorch's CPU allocator that keeps the
// bytes its allocations hold now and the most they held at once (libtorch 2.11 keeps such
// statistics for CUDA's caching allocator only).
//
//   tdist::track_cpu_memory();              // from now on, CPU tensors are counted
//   tdist::reset_peak_cpu_memory();         // the peak starts again from what is held now
//   ... train ...
//   auto s = tdist::cpu_memory_stats();     // s.allocated_bytes, s.peak_bytes
//
// What it counts: the bytes asked for by every CPU storage allocated through
// c10::GetCPUAllocator() after track_cpu_memory() (parameters, gradients, optimizer state,
// activations, communication buffers), until each is freed. Storages allocated before are
// not counted, neither when they live nor when they go. Not counted: memory that is no tensor
// (the interpreter, libraries, std containers), and the allocator's own rounding. CPU tensors
// whose memory comes from elsewhere are counted when their maker says so
// (count_other_cpu_memory: the process group's symmetric memory, comm/ring/symmetric_memory.h).
//
// Thread safety: every function is thread safe; the counters are atomics that any thread's
// allocation or free updates. track_cpu_memory installs the wrapper once per process (later
// calls do nothing) and it stays for the life of the process. Python reaches the same counters
// through the tdist_c10d module (docs/pytorch.md), so a PyTorch program is measured alike.

#include <cstdint>

namespace tdist {

struct CpuMemoryStats {
  int64_t allocated_bytes = 0;  // held now by counted CPU storages
  int64_t peak_bytes = 0;       // the most held at once since tracking began or the last reset
  int64_t allocations = 0;      // counted allocations so far
};

// Wraps the CPU allocator libtorch uses now with the counting one (c10::SetCPUAllocator). Error
// when that allocator cannot hand out raw memory (no raw deleter), which the wrapper needs.
void track_cpu_memory();
// Whether track_cpu_memory() ran in this process.
bool cpu_memory_tracked();
// The counters (zeros when not tracked).
CpuMemoryStats cpu_memory_stats();
// Sets the peak to what is held now.
void reset_peak_cpu_memory();
// Counts `bytes` more (a CPU tensor's memory allocated outside libtorch's allocator) or, negative,
// fewer (freed); nothing when not tracked.
void count_other_cpu_memory(int64_t bytes);

}  // namespace tdist
