#pragma once
// Buckets: groups of parameters whose gradients travel together in one flat tensor.
// See Note [DDP bucketing] in reducer.h for how they are filled, launched and finished.

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tdist/comm/work.h"

namespace tdist::comm {
class ProcessGroup;
}

namespace tdist::ddp {

// Splits `order` (parameter indices, in the order their gradients are expected to become ready)
// into buckets: consecutive parameters of one dtype and device share a bucket until it holds at
// least `first_cap_bytes` (the first bucket of each dtype) or `cap_bytes` (the rest). Each
// parameter lands in exactly one bucket; the buckets are returned in the order of their first
// parameter in `order`. Pure function; throws InvalidArgument for a sparse or undefined param.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& params,
                                                const std::vector<size_t>& order,
                                                size_t first_cap_bytes, size_t cap_bytes);

// One bucket's storage and bookkeeping. Owned by the Reducer; not thread safe (the Reducer
// guards it with its mutex).
struct Bucket {
  std::vector<size_t> params;     // parameter indices, in bucket order
  std::vector<int64_t> offsets;   // element offset of each parameter in `buffer`
  std::vector<int64_t> lengths;   // element count of each parameter
  at::Tensor buffer;              // flat, dtype and device of the parameters
  std::vector<at::Tensor> views;  // buffer regions shaped like each parameter
  // What the built-in hook reduces on the CPU without bucket views (Note [DDP bucketing] 11), per
  // slot: the gradient itself, or its view (which it was copied into).
  std::vector<at::Tensor> targets;
  // `buffer` is the group's symmetric memory (Note [DDP bucketing] 12).
  bool symmetric = false;

  // Per iteration:
  size_t pending = 0;                    // gradients not yet ready
  std::shared_ptr<comm::Future> future;  // the comm hook's future once launched
  std::shared_ptr<comm::Work> work;      // off the CPU: the allreduce's (Note [DDP bucketing] 10)
  int64_t launch_us = 0;                 // trace: when the hook was called

  // Allocates `buffer` (zeros, with the parameters' dtype and device) and `views` for `params`.
  // With `pg`, a host buffer is the group's symmetric memory (Note [DDP bucketing] 12): a
  // collective call, so every rank allocates the same buckets in the same order.
  void allocate(const std::vector<at::Tensor>& all_params, comm::ProcessGroup* pg = nullptr);
  size_t bytes() const;
};

// What a communication hook sees of a bucket (PyTorch's GradBucket). The hook may read and
// overwrite buffer() in place; it must not keep references past its future's completion.
class GradBucket {
 public:
  GradBucket(size_t index, size_t num_buckets, at::Tensor buffer, std::vector<at::Tensor> gradients,
             std::vector<at::Tensor> parameters, std::vector<int64_t> offsets,
             std::shared_ptr<comm::ProcessGroup> pg)
      : index_(index),
        num_buckets_(num_buckets),
        buffer_(std::move(buffer)),
        gradients_(std::move(gradients)),
        parameters_(std::move(parameters)),
        offsets_(std::move(offsets)),
        pg_(std::move(pg)) {}

  size_t index() const { return index_; }
  bool is_last() const { return index_ + 1 == num_buckets_; }
  // The flat gradients of this bucket (a hook reduces this).
  const at::Tensor& buffer() const { return buffer_; }
  // Views of buffer() shaped like parameters(), in bucket order.
  const std::vector<at::Tensor>& gradients() const { return gradients_; }
  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  // Element offset of each gradient in buffer().
  const std::vector<int64_t>& offsets() const { return offsets_; }
  const std::shared_ptr<comm::ProcessGroup>& process_group() const { return pg_; }

 private:
  size_t index_;
  size_t num_buckets_;
  at::Tensor buffer_;
  std::vector<at::Tensor> gradients_;
  std::vector<at::Tensor> parameters_;
  std::vector<int64_t> offsets_;
  std::shared_ptr<comm::ProcessGroup> pg_;
};

}  // namespace tdist::ddp
