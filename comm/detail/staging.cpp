#include "tdist/comm/detail/staging.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/tensor_wire.h"

namespace tdist::comm::detail {
namespace {

using algorithms::ByteRange;

std::mutex hook_mu;
StagingForTests hook;

StagingForTests current_hook() {
  std::lock_guard<std::mutex> lock(hook_mu);
  return hook;
}

// Host memory for t's values (pinned for a CUDA tensor), not initialized.
at::Tensor new_host_memory(const at::Tensor& t) {
  return at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(t.device().is_cuda()));
}

// A contiguous tensor's bytes as a flat byte tensor (same memory).
at::Tensor bytes_of(const at::Tensor& t) { return t.reshape({-1}).view(at::kByte); }

// Device-to-host copies on the caller's stream with an event after each piece; host-to-device
// copies on a side stream from the pool.
class DeviceEngine final : public StagedTensor::Engine {
 public:
  DeviceEngine(const at::Tensor& dev, const at::Tensor& host, const std::vector<ByteRange>& order)
      : dev_(bytes_of(dev)), host_(bytes_of(host)) {
    c10::impl::VirtualGuardImpl impl(dev.device().type());
    const c10::Stream caller = impl.getStream(dev.device());
    side_ = impl.getStreamFromGlobalPool(dev.device());
    events_.reserve(order.size());
    for (const ByteRange& p : order) {
      range(host_, p).copy_(range(dev_, p), /*non_blocking=*/true);
      events_.emplace_back(dev.device().type());
      events_.back().record(caller);
    }
  }
  ~DeviceEngine() override {
    // A failed operation still has copies out in flight into the tensor's memory.
    try {
      side_.synchronize();
    } catch (const std::exception& e) {
      TDIST_LOG_ERROR("staging: waiting for the copies of a failed operation: ", e.what());
    }
  }
  bool arrived(size_t piece) override { return events_[piece].query(); }
  void copy_out(size_t begin, size_t end) override {
    c10::StreamGuard on(side_);
    range(dev_, {begin, end}).copy_(range(host_, {begin, end}), /*non_blocking=*/true);
  }
  void drain() override { side_.synchronize(); }

 private:
  static at::Tensor range(const at::Tensor& t, ByteRange r) {
    return t.narrow(0, static_cast<int64_t>(r.begin), static_cast<int64_t>(r.end - r.begin));
  }
  at::Tensor dev_, host_;
  c10::Stream side_{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
  std::vector<c10::Event> events_;
};

// The testing hook: a thread copies the pieces in order, each after a delay; copies out are
// immediate.
class ThreadEngine final : public StagedTensor::Engine {
 public:
  ThreadEngine(const at::Tensor& src, const at::Tensor& host, const std::vector<ByteRange>& order,
               std::chrono::microseconds delay)
      : bytes_(src.nbytes()),
        src_(static_cast<char*>(src.data_ptr())),
        host_(static_cast<char*>(host.data_ptr())) {
    thread_ = std::thread([this, order, delay] {
      for (size_t i = 0; i < order.size(); ++i) {
        std::this_thread::sleep_for(delay);
        std::memcpy(host_ + order[i].begin, src_ + order[i].begin, order[i].end - order[i].begin);
        arrived_.store(i + 1, std::memory_order_release);
      }
    });
  }
  ~ThreadEngine() override { thread_.join(); }
  bool arrived(size_t piece) override { return piece < arrived_.load(std::memory_order_acquire); }
  void copy_out(size_t begin, size_t end) override {
    std::memcpy(src_ + begin, host_ + begin, end - begin);
    outs_.push_back({begin, end});
  }
  // Every byte must have been finished exactly once (or none: a staged input): a range finished
  // before its values were final and again later would pass unseen otherwise.
  void drain() override {
    if (outs_.empty()) return;
    std::sort(outs_.begin(), outs_.end(),
              [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
    size_t covered = 0;
    for (const ByteRange& r : outs_) {
      TDIST_CHECK(r.begin == covered, "staging: bytes from ", std::min(r.begin, covered),
                  r.begin < covered ? " were finished twice" : " were never finished");
      covered = r.end;
    }
    TDIST_CHECK(covered == bytes_, "staging: bytes from ", covered, " were never finished");
  }

 private:
  size_t bytes_;
  std::vector<ByteRange> outs_;
  char* src_;
  char* host_;
  std::atomic<size_t> arrived_{0};
  std::thread thread_;
};

}  // namespace

void check_stageable(const at::Tensor& t, const char* op, const char* what) {
  TDIST_CHECK_ARG(t.defined(), op, ": ", what, " is undefined");
  TDIST_CHECK_ARG(t.device().is_cpu() || t.device().is_cuda(), op, ": ", what, " is a ",
                  t.device().str(), " tensor; the ring backend serves CPU and CUDA tensors");
  TDIST_CHECK_ARG(t.layout() == c10::kStrided, op, ": ", what, " is sparse; only dense tensors "
                  "are supported");
}

at::Tensor host_values(const at::Tensor& t) {
  if (t.device().is_cpu()) return contiguous_values(t);
  at::Tensor values = contiguous_values(t);  // resolved on the device
  at::Tensor host = at::empty(values.sizes(), values.options()
                                                  .device(at::kCPU)
                                                  .pinned_memory(values.device().is_cuda()));
  host.copy_(values);
  return host;
}

at::Tensor host_output(const at::Tensor& t) {
  if (t.device().is_cpu() && t.is_contiguous() && !t.is_conj() && !t.is_neg()) return t;
  return new_host_memory(t);
}

void set_staging_for_tests(const StagingForTests& s) {
  std::lock_guard<std::mutex> lock(hook_mu);
  hook = s;
}

size_t StagedTensor::piece_bytes() { return current_hook().piece_bytes; }

bool StagedTensor::wanted(const at::Tensor& t, int size) {
  if (size < 2 || !t.is_contiguous() || t.is_conj() || t.is_neg()) return false;
  if (!t.device().is_cuda() && !(t.device().is_cpu() && current_hook().cpu)) return false;
  return static_cast<size_t>(t.numel()) * t.element_size() >= 2 * piece_bytes();
}

StagedTensor::StagedTensor(at::Tensor t, std::vector<ByteRange> order)
    : StagedTensor(t, new_host_memory(t), std::move(order)) {}

StagedTensor::StagedTensor(at::Tensor t, at::Tensor host, std::vector<ByteRange> order)
    : Staging(static_cast<const char*>(host.data_ptr()), std::move(order)),
      tensor_(std::move(t)),
      host_(std::move(host)),
      piece_(piece_bytes()) {
  if (tensor_.device().is_cuda()) {
    engine_ = std::make_unique<DeviceEngine>(tensor_, host_, this->order());
  } else {
    std::memset(host_.data_ptr(), 0xff, host_.nbytes());
    engine_ = std::make_unique<ThreadEngine>(tensor_, host_, this->order(), current_hook().delay);
  }
}

StagedTensor::~StagedTensor() = default;

bool StagedTensor::arrived(size_t piece) {
  // Pieces arrive in order: remember how far they have.
  while (known_ <= piece) {
    if (!engine_->arrived(known_)) return false;
    ++known_;
  }
  return true;
}

void StagedTensor::finished(size_t begin, size_t end) {
  if (pending_.end == begin && pending_.end > pending_.begin) {
    pending_.end = end;  // the ring finishes each segment's chunks in ascending order
  } else {
    flush();
    pending_ = {begin, end};
  }
  if (pending_.end - pending_.begin >= piece_) flush();
}

void StagedTensor::flush() {
  if (pending_.end > pending_.begin) engine_->copy_out(pending_.begin, pending_.end);
  pending_ = {0, 0};
}

void StagedTensor::complete() {
  flush();
  engine_->drain();
}

}  // namespace tdist::comm::detail
