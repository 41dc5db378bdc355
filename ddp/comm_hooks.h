#pragma once
// Communication hooks (PyTorch's DDP comm hooks): how a ready bucket's gradients are averaged
// across ranks. A hook is called with the bucket once all its gradients are ready, on the thread
// that runs backward, and returns at once a Future whose value[0] is the averaged flat gradient
// (numel of bucket.buffer(), any floating dtype; it may be buffer() itself).
//
// Hooks run without the Reducer's lock: a hook may call the Reducer's introspection methods, or
// wait for another thread that does.
//
// Ordering contract: collectives must be issued in the same order on every rank. The Reducer
// calls hooks in bucket order on every rank; a hook that issues its collectives inside the call
// keeps that order. A hook that issues collectives later (after waiting for an earlier one) must
// issue them from one thread that serves buckets in the order the hook was called: powersgd_hook
// does that with a worker thread of its own. Under find_unused_parameters the Reducer issues a
// collective of its own (the allreduce of the used map) right after the call for the last bucket
// (bucket.is_last()) returns, as PyTorch does: by then every collective of every bucket must
// have been issued, so a hook that issues later returns from its last call only once that is
// done (powersgd_hook waits there for its worker).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "tdist/comm/work.h"
#include "tdist/ddp/bucket.h"

namespace tdist::ddp {

using CommHook = std::function<std::shared_ptr<comm::Future>(GradBucket& bucket)>;

// The default: buffer /= world size, then allreduce(SUM) in place.
CommHook allreduce_hook();

// Compress to float16 (bfloat16), divide by the world size, allreduce, and write the result back
// into the bucket's dtype. Half the bytes on the wire; rounding error of the 16-bit type.
CommHook fp16_compress_hook();
CommHook bf16_compress_hook();

// PowerSGD (Vogels et al., 2019), as PyTorch's powerSGD_hook: each gradient matrix M (n x m,
// higher-rank tensors flattened to n x rest) is approximated by P Q^T of rank r:
// P = M Q; allreduce P; orthonormalize P; Q = M^T P; allreduce Q; M ~ P Q^T / world. Vectors
// (biases) and matrices too small to gain are allreduced uncompressed, packed with P.
struct PowerSGDOptions {
  int matrix_approximation_rank = 1;
  // Plain allreduce for the iterations before this one (buckets are rebuilt after iteration 1,
  // and early gradients change fast). Counted in finished backward passes, from 0.
  int64_t start_powerSGD_iter = 10;
  // Compress a matrix only when (n*m) >= min_compression_rate * r*(n+m).
  double min_compression_rate = 2.0;
  // Add last iteration's compression error to the gradient before compressing.
  bool use_error_feedback = true;
  // Start each iteration's Q from the previous iteration's (else fresh random Q).
  bool warm_start = true;
  // Seed of the random initial Q (the same on every rank, so every rank starts from the same Q).
  uint64_t seed = 0;
};

// The returned hook owns a worker thread that runs all of its collectives in bucket order (see
// the ordering contract above); the thread stops when the last copy of the hook is destroyed.
// The hook is stateful (error feedback, Q): register one per DDP instance.
CommHook powersgd_hook(PowerSGDOptions opts = {});

}  // namespace tdist::ddp
