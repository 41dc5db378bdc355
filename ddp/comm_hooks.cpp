#include "tdist/ddp/comm_hooks.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"

namespace tdist::ddp {

CommHook allreduce_hook() {
  return [](GradBucket& bucket) {
    auto& pg = bucket.process_group();
    bucket.buffer().div_(pg->size());
    return pg->allreduce(bucket.buffer())->future();
  };
}

namespace {

CommHook compress_hook(at::ScalarType wire_type) {
  return [wire_type](GradBucket& bucket) {
    auto& pg = bucket.process_group();
    at::Tensor compressed = bucket.buffer().to(wire_type).div_(pg->size());
    at::Tensor buffer = bucket.buffer();
    return pg->allreduce(compressed)->future()->then([compressed, buffer](comm::Future&) {
      buffer.copy_(compressed);
      return comm::Future::Value{buffer};
    });
  };
}

}  // namespace

CommHook fp16_compress_hook() { return compress_hook(at::kHalf); }
CommHook bf16_compress_hook() { return compress_hook(at::kBFloat16); }

namespace {

// Orthonormalizes the columns of `m` (n x r) in place: Gram-Schmidt with a second projection
// pass ("twice is enough") so that the columns stay orthogonal in float even when some are
// nearly dependent. A column with (almost) nothing left after the projections becomes zero, so
// P P^T never adds a direction that is not in the data.
void orthonormalize_columns(at::Tensor& m) {
  const int64_t r = m.size(1);
  for (int64_t i = 0; i < r; ++i) {
    at::Tensor col = m.select(1, i);
    const double before = col.norm().item<double>();
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t j = 0; j < i; ++j) {
        at::Tensor prev = m.select(1, j);
        col.sub_(prev * at::dot(prev, col));
      }
    }
    const double after = col.norm().item<double>();
    if (before > 0 && after > 1e-5 * before) {
      col.div_(after);
    } else {
      col.zero_();
    }
  }
}

// Shared state of one powersgd_hook: the worker thread and its queue, and per-bucket
// error-feedback and Q matrices. Guarded by mu_ where noted; the per-bucket state is touched
// only by the worker thread.
class PowerSGD {
 public:
  explicit PowerSGD(PowerSGDOptions opts) : opts_(opts) {
    TDIST_CHECK_ARG(opts_.matrix_approximation_rank >= 1,
                    "PowerSGD matrix_approximation_rank must be >= 1, got ",
                    opts_.matrix_approximation_rank);
    TDIST_CHECK_ARG(opts_.start_powerSGD_iter >= 0, "PowerSGD start_powerSGD_iter must be >= 0");
    worker_ = std::thread([this] { run(); });
  }
  ~PowerSGD() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  std::shared_ptr<comm::Future> enqueue(GradBucket bucket) {
    auto fut = std::make_shared<comm::Future>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(Job{std::move(bucket), fut});
    }
    cv_.notify_one();
    return fut;
  }

 private:
  struct Job {
    GradBucket bucket;
    std::shared_ptr<comm::Future> future;
  };
  struct BucketState {
    int64_t numel = -1;
    at::Tensor error;            // error feedback, like the bucket buffer
    std::vector<at::Tensor> qs;  // warm-start Q per compressed matrix
  };

  void run() {
    for (;;) {
      Job job{GradBucket(0, 0, {}, {}, {}, {}, nullptr), nullptr};
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and nothing left
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      try {
        at::Tensor out = reduce(job.bucket);
        job.future->set_value({out});
      } catch (...) {
        job.future->set_error(std::current_exception());
      }
    }
  }

  at::Tensor reduce(GradBucket& bucket) {
    auto& pg = bucket.process_group();
    const double world = pg->size();
    at::Tensor buffer = bucket.buffer();
    const bool compress = iter_ >= opts_.start_powerSGD_iter;
    if (bucket.is_last()) ++iter_;
    if (!compress) {
      buffer.div_(world);
      pg->allreduce(buffer)->wait();
      return buffer;
    }

    BucketState& st = state_[bucket.index()];
    if (st.numel != buffer.numel()) {  // first use, or buckets were rebuilt
      st = BucketState{};
      st.numel = buffer.numel();
    }
    if (opts_.use_error_feedback) {
      if (!st.error.defined()) st.error = at::zeros_like(buffer);
      buffer.add_(st.error);
    }
    at::Tensor input = opts_.use_error_feedback ? buffer.clone() : at::Tensor();

    // Split the gradients into matrices worth compressing and the rest.
    std::vector<at::Tensor> matrices, plain;
    for (const at::Tensor& g : bucket.gradients()) {
      if (g.dim() >= 2) {
        int64_t n = g.size(0), m = g.numel() / std::max<int64_t>(n, 1);
        int64_t r = std::min<int64_t>({opts_.matrix_approximation_rank, n, m});
        if (r > 0 && static_cast<double>(n) * m >= opts_.min_compression_rate * r * (n + m)) {
          matrices.push_back(g.view({n, m}));
          continue;
        }
      }
      plain.push_back(g);
    }
    if (st.qs.size() != matrices.size() || !opts_.warm_start) {
      st.qs.clear();
      // The same seed on every rank gives every rank the same initial Q, drawn on the host
      // whatever the gradients' device (the same Q on every device) and moved to theirs.
      at::Generator gen = at::detail::createCPUGenerator(opts_.seed + static_cast<uint64_t>(iter_));
      for (const at::Tensor& mat : matrices) {
        int64_t r = std::min<int64_t>({opts_.matrix_approximation_rank, mat.size(0), mat.size(1)});
        at::Tensor q = at::randn({mat.size(1), r}, gen, at::TensorOptions().dtype(at::kFloat))
                           .to(mat.device(), mat.scalar_type());
        orthonormalize_columns(q);
        st.qs.push_back(q);
      }
    }

    // First allreduce: the uncompressed gradients (averaged) and every P = M Q (summed).
    int64_t plain_numel = 0, p_numel = 0;
    for (const auto& g : plain) plain_numel += g.numel();
    for (size_t i = 0; i < matrices.size(); ++i) p_numel += matrices[i].size(0) * st.qs[i].size(1);
    at::Tensor packed = at::empty({plain_numel + p_numel}, buffer.options());
    std::vector<at::Tensor> ps;
    int64_t off = 0;
    for (const auto& g : plain) {
      packed.narrow(0, off, g.numel()).copy_(g.reshape({-1})).div_(world);
      off += g.numel();
    }
    for (size_t i = 0; i < matrices.size(); ++i) {
      int64_t n = matrices[i].size(0), r = st.qs[i].size(1);
      at::Tensor p = packed.narrow(0, off, n * r).view({n, r});
      at::mm_out(p, matrices[i], st.qs[i]);
      ps.push_back(p);
      off += n * r;
    }
    if (packed.numel() > 0) pg->allreduce(packed)->wait();
    off = 0;
    for (const auto& g : plain) {
      g.copy_(packed.narrow(0, off, g.numel()).view(g.sizes()));
      off += g.numel();
    }

    // Second allreduce: Q = M^T P with P orthonormalized (identically on every rank).
    if (!matrices.empty()) {
      int64_t q_numel = 0;
      for (const auto& q : st.qs) q_numel += q.numel();
      at::Tensor qpacked = at::empty({q_numel}, buffer.options());
      std::vector<at::Tensor> qs;
      off = 0;
      for (size_t i = 0; i < matrices.size(); ++i) {
        orthonormalize_columns(ps[i]);
        at::Tensor q = qpacked.narrow(0, off, st.qs[i].numel()).view(st.qs[i].sizes());
        at::mm_out(q, matrices[i].t(), ps[i]);
        qs.push_back(q);
        off += q.numel();
      }
      pg->allreduce(qpacked)->wait();
      qpacked.div_(world);
      for (size_t i = 0; i < matrices.size(); ++i) {
        at::mm_out(matrices[i], ps[i], qs[i].t());  // writes into the bucket buffer
        st.qs[i] = qs[i].clone();
      }
    }
    if (opts_.use_error_feedback) st.error = input - buffer;
    return buffer;
  }

  const PowerSGDOptions opts_;
  std::thread worker_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;  // guarded by mu_
  bool stop_ = false;      // guarded by mu_
  // Worker thread only:
  int64_t iter_ = 0;
  std::map<size_t, BucketState> state_;
};

}  // namespace

CommHook powersgd_hook(PowerSGDOptions opts) {
  auto state = std::make_shared<PowerSGD>(opts);
  return [state](GradBucket& bucket) {
    auto future = state->enqueue(bucket);
    if (bucket.is_last()) {
      // The ordering contract (comm_hooks.h): every collective of this backward is issued
      // before the last call returns, so none interleaves with the Reducer's used-map
      // allreduce. The worker serves buckets in order; this one is the last. An error (or the
      // group's timeout) stays in the future, which the Reducer reports with the bucket.
      try {
        future->wait();
      } catch (const std::exception&) {}
    }
    return future;
  };
}

}  // namespace tdist::ddp
