#pragma once
// Where received tensors live, and how large ones are copied in.
//
// empty_for_receive(): a new CPU tensor for incoming bytes. Tensors of at least kMinCached bytes
// get storage from a small process-wide cache of freed blocks (exact sizes, at most
// kMaxCachedBytes in all): a block comes back when its tensor dies, so receiving tensors of
// the same sizes again and again (parameters, activations, benchmarks) reuses memory whose pages
// are already mapped instead of paying a page fault per 4 KiB on every receive. The storage is
// ordinary resizable CPU storage.
//
// receive_tensor(): a new CPU tensor whose bytes read(dst, size) brings in, in order. Its storage
// grows as the bytes arrive, so a peer that announces a large tensor and sends less makes us
// hold about twice what it sent, never what it announced (the frame's length bounds the
// announcement, by RpcOptions::max_frame_bytes, 4 GiB by default: that bound is not a cost we
// take on a peer's word). Tensors below kMinCached are allocated at once; larger ones reuse a
// cached block of their exact size if there is one (memory the process already holds), and
// otherwise start as a kFirstReceiveChunk mapping that doubles (mremap, no copy) each time it is
// full.
//
// parallel_copy(): runs copy(offset, size) over [0, total) in chunks, on the calling thread and
// on a few process-wide helper threads that do nothing else (so a copy never waits behind user
// code). Blocks until all chunks are done; rethrows the first chunk's error.
// Thread safety: both may be called from any thread.

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <cstdint>
#include <functional>

#include "tdist/core/tensor_wire.h"

namespace tdist::rpc::detail {

constexpr uint64_t kMinCached = uint64_t{1} << 20;
constexpr uint64_t kMaxCachedBytes = uint64_t{256} << 20;

constexpr uint64_t kFirstReceiveChunk = uint64_t{1} << 20;

// n rounded up to whole pages.
size_t page_rounded(uint64_t n);

at::Tensor empty_for_receive(const TensorMeta& meta);

// A tensor of `meta` whose storage is `data` (meta.nbytes bytes): ordinary resizable CPU storage,
// growing into the cache above (rpc/detail/shm_tensors.h puts received slots in it).
at::Tensor tensor_on_data(c10::DataPtr data, const TensorMeta& meta);

at::Tensor receive_tensor(const TensorMeta& meta,
                          const std::function<void(void* dst, size_t size)>& read);

void parallel_copy(uint64_t total, const std::function<void(uint64_t offset, uint64_t size)>& copy);

}  // namespace tdist::rpc::detail
