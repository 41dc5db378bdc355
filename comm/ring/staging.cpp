#include "tdist/comm/ring/staging.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <thread>

#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/tensor_wire.h"

namespace tdist::comm::detail {
namespace {

using algorithms::ByteRange;

std::mutex hook_mu;
StagingForTests hook;
// hook.cpu and hook.strided, read without the lock on every operation's path.
std::atomic<bool> hook_cpu{false};
std::atomic<bool> hook_strided{false};
std::atomic<size_t> staged_count{0};
std::atomic<size_t> staged_live_bytes{0};
std::atomic<size_t> staged_peak_bytes{0};

StagingForTests current_hook() {
  std::lock_guard<std::mutex> lock(hook_mu);
  return hook;
}

using Part = StagedTensors::Part;

// Host memory for t's values (pinned for a CUDA tensor), not initialized.
at::Tensor new_host_memory(const at::Tensor& t) {
  return at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(t.device().is_cuda()));
}

// Whether the staging can take t as it is: contiguous, without a conjugate or negative bit.
bool dense(const at::Tensor& t) { return t.is_contiguous() && !t.is_conj() && !t.is_neg(); }

// A slot's tensors: either one (they have the same bytes and device).
const at::Tensor& either(const StagedTensors::Slot& s) { return s.in.defined() ? s.in : s.out; }

// Flat byte views of the slots' tensors, one after the other.
std::vector<Part> parts_of(const std::vector<StagedTensors::Slot>& slots) {
  auto flat = [](const at::Tensor& t) { return t.defined() ? flat_bytes(t) : t; };
  std::vector<Part> parts;
  size_t offset = 0;
  for (const StagedTensors::Slot& s : slots) {
    TDIST_CHECK(!s.in.defined() || !s.out.defined() || s.in.nbytes() == s.out.nbytes(),
                "staging: a slot's input has ", s.in.nbytes(), " bytes, its output ",
                s.out.nbytes());
    parts.push_back(Part{offset, either(s).nbytes(), flat(s.in), flat(s.out)});
    offset += parts.back().size;
  }
  return parts;
}

// One flat byte buffer for all the slots (pinned for CUDA tensors), not initialized.
at::Tensor host_memory_for(const std::vector<StagedTensors::Slot>& slots) {
  size_t bytes = 0;
  for (const StagedTensors::Slot& s : slots) bytes += either(s).nbytes();
  const bool cuda = either(slots.at(0)).device().is_cuda();
  return at::empty({static_cast<int64_t>(bytes)},
                   at::TensorOptions().dtype(at::kByte).pinned_memory(cuda));
}

at::Tensor byte_range(const at::Tensor& bytes, size_t begin, size_t end) {
  return bytes.narrow(0, static_cast<int64_t>(begin), static_cast<int64_t>(end - begin));
}

// f(t, begin, end) for every part's share [begin, end) (host offsets) of bytes [b, e), t being
// the part's `in` or `out` byte tensor (`which`) viewed at that share. A range that reaches a
// part without that tensor is a bug of the algorithm.
template <typename F>
void for_parts(const std::vector<Part>& parts, at::Tensor Part::*which, size_t b, size_t e, F&& f) {
  for (const Part& p : parts) {
    const size_t lo = std::max(b, p.offset);
    const size_t hi = std::min(e, p.offset + p.size);
    if (lo >= hi) continue;
    const at::Tensor& t = p.*which;
    TDIST_CHECK(t.defined(), "staging: bytes ", lo, "..", hi, " of the host buffer are ",
                which == &Part::in ? "copied in" : "finished", " but that part has no ",
                which == &Part::in ? "input" : "output");
    f(byte_range(t, lo - p.offset, hi - p.offset), lo, hi);
  }
}

}  // namespace

// A point of the caller's stream (StagedTensors::mark_issue).
struct IssueMark {
  explicit IssueMark(c10::Device dev) : event(dev.type()) {
    event.record(c10::impl::VirtualGuardImpl(dev.type()).getStream(dev));
  }
  c10::Event event;
};

namespace {

// Device-to-host copies on the caller's stream (or on a side stream after the caller's issue
// point) with an event after each piece; host-to-device copies on a side stream from the pool.
class DeviceEngine final : public StagedTensors::Engine {
 public:
  DeviceEngine(std::vector<Part> parts, const at::Tensor& host, const std::vector<ByteRange>& order,
               const IssueMark* issue, c10::Device dev)
      : parts_(std::move(parts)), host_(host), start_(dev.type()) {
    c10::impl::VirtualGuardImpl impl(dev.type());
    c10::Stream in = impl.getStream(dev);
    if (issue != nullptr) {
      in = impl.getStreamFromGlobalPool(dev);
      issue->event.block(in);
      own_in_ = in;
    }
    side_ = impl.getStreamFromGlobalPool(dev);
    // The copies out write the tensors: not before what was queued ahead of the operation.
    start_.record(in);
    start_.block(side_);
    c10::StreamGuard on(in);
    events_.reserve(order.size());
    for (const ByteRange& piece : order) {
      for_parts(parts_, &Part::in, piece.begin, piece.end,
                [&](const at::Tensor& t, size_t lo, size_t hi) {
                  byte_range(host_, lo, hi).copy_(t, /*non_blocking=*/true);
                });
      events_.emplace_back(dev.type());
      events_.back().record(in);
    }
  }
  ~DeviceEngine() override {
    // A failed operation still has copies in and out in flight between the tensors' memory and
    // the host buffer.
    try {
      if (own_in_) own_in_->synchronize();
      side_.synchronize();
    } catch (const std::exception& e) {
      TDIST_LOG_ERROR("staging: waiting for the copies of a failed operation: ", e.what());
    }
  }
  bool arrived(size_t piece) override { return events_[piece].query(); }
  void copy_out(size_t begin, size_t end) override {
    c10::StreamGuard on(side_);
    for_parts(parts_, &Part::out, begin, end, [&](const at::Tensor& t, size_t lo, size_t hi) {
      t.copy_(byte_range(host_, lo, hi), /*non_blocking=*/true);
    });
  }
  void drain() override { side_.synchronize(); }

 private:
  std::vector<Part> parts_;
  at::Tensor host_;                    // flat bytes
  std::optional<c10::Stream> own_in_;  // the copies in's side stream, if not the caller's
  c10::Stream side_{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
  c10::Event start_;  // where the copies in start from
  std::vector<c10::Event> events_;
};

// The testing hook: a thread copies the pieces in, each after the hook's delay, in order; or,
// device-like, in a random order, each after a random delay of up to it. Copies out run at once;
// or, device-like, in order on a second thread, each after a random delay, reading the host
// buffer when it runs (as a device copy queued on a stream does).
class ThreadEngine final : public StagedTensors::Engine {
 public:
  ThreadEngine(std::vector<Part> parts, const at::Tensor& host, const std::vector<ByteRange>& order,
               const StagingForTests& hook)
      : parts_(std::move(parts)),
        host_(static_cast<char*>(host.data_ptr())),
        device_like_(hook.device_like),
        delay_(hook.delay),
        arrived_(new std::atomic<bool>[order.size()]()) {
    std::vector<size_t> sequence(order.size());
    std::iota(sequence.begin(), sequence.end(), size_t{0});
    std::mt19937 rng(std::random_device{}());
    if (device_like_) std::shuffle(sequence.begin(), sequence.end(), rng);
    in_ = std::thread([this, order, sequence, seed = rng()] {
      std::mt19937 rng(seed);
      for (size_t i : sequence) {
        std::this_thread::sleep_for(next_delay(rng));
        for_parts(parts_, &Part::in, order[i].begin, order[i].end,
                  [&](const at::Tensor& t, size_t lo, size_t hi) {
                    std::memcpy(host_ + lo, t.data_ptr(), hi - lo);
                  });
        arrived_[i].store(true, std::memory_order_release);
      }
    });
    if (device_like_) out_ = std::thread([this, seed = rng()] { copy_out_loop(seed); });
  }
  ~ThreadEngine() override {
    in_.join();
    if (out_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
      }
      cv_.notify_all();
      out_.join();  // a failed operation's copies out still run, as a device's would
    }
  }
  bool arrived(size_t piece) override { return arrived_[piece].load(std::memory_order_acquire); }
  void copy_out(size_t begin, size_t end) override {
    outs_.push_back({begin, end});
    if (!device_like_) {
      copy(begin, end);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      queued_.push_back({begin, end});
    }
    cv_.notify_all();
  }
  // Every byte of every part with an output must have been finished exactly once (copy_out
  // refuses the others): a range finished before its values were final and again later would
  // pass unseen otherwise. A failed operation stops early, so only a drain (its completion) is
  // checked.
  void drain() override {
    if (device_like_) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return queued_.empty(); });
    }
    std::sort(outs_.begin(), outs_.end(),
              [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
    std::vector<ByteRange> covered;  // the finished bytes, as maximal runs
    for (const ByteRange& r : outs_) {
      TDIST_CHECK(covered.empty() || r.begin >= covered.back().end, "staging: bytes from ", r.begin,
                  " were finished twice");
      if (!covered.empty() && r.begin == covered.back().end) {
        covered.back().end = r.end;
      } else {
        covered.push_back(r);
      }
    }
    for (const Part& p : parts_) {
      if (!p.out.defined()) continue;
      auto run = std::upper_bound(covered.begin(), covered.end(), p.offset,
                                  [](size_t b, const ByteRange& r) { return b < r.begin; });
      const size_t from =
          run == covered.begin() ? p.offset : std::max(p.offset, std::prev(run)->end);
      TDIST_CHECK(from >= p.offset + p.size, "staging: bytes from ", from, " were never finished");
    }
  }

 private:
  std::chrono::microseconds next_delay(std::mt19937& rng) const {
    if (!device_like_) return delay_;
    return std::chrono::microseconds(
        std::uniform_int_distribution<int64_t>(0, delay_.count())(rng));
  }
  void copy(size_t begin, size_t end) {
    for_parts(parts_, &Part::out, begin, end, [&](const at::Tensor& t, size_t lo, size_t hi) {
      std::memcpy(t.data_ptr(), host_ + lo, hi - lo);
    });
  }
  // The device-like copies out: the queue's head is removed once it was copied, so an empty
  // queue means every copy asked for is done.
  void copy_out_loop(uint32_t seed) {
    std::mt19937 rng(seed);
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !queued_.empty(); });
      if (queued_.empty()) return;
      const ByteRange r = queued_.front();
      lock.unlock();
      std::this_thread::sleep_for(next_delay(rng));
      copy(r.begin, r.end);
      lock.lock();
      queued_.pop_front();
      cv_.notify_all();
    }
  }

  // Constant after construction.
  const std::vector<Part> parts_;
  char* const host_;
  const bool device_like_;
  const std::chrono::microseconds delay_;
  const std::unique_ptr<std::atomic<bool>[]> arrived_;  // by position in the order

  std::vector<ByteRange> outs_;  // every range asked to be copied out (the operation's thread)
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<ByteRange> queued_;  // guarded by mu_: device-like copies out not yet done
  bool stop_ = false;             // guarded by mu_
  std::thread in_;
  std::thread out_;
};

}  // namespace

void check_stageable(const at::Tensor& t, const char* op, const char* what) {
  TDIST_CHECK_ARG(t.defined(), op, ": ", what, " is undefined");
  TDIST_CHECK_ARG(t.device().is_cpu() || t.device().is_cuda(), op, ": ", what, " is a ",
                  t.device().str(), " tensor; the ring backend serves CPU and CUDA tensors");
  TDIST_CHECK_ARG(t.layout() == c10::kStrided, op, ": ", what,
                  " is sparse; only dense tensors "
                  "are supported");
}

at::Tensor host_values(const at::Tensor& t) {
  if (t.device().is_cpu()) return contiguous_values(t);
  at::Tensor values = contiguous_values(t);  // resolved on the device
  at::Tensor host = new_host_memory(values);
  host.copy_(values);
  return host;
}

at::Tensor host_output(const at::Tensor& t) {
  if (t.device().is_cpu() && dense(t)) return t;
  return new_host_memory(t);
}

void set_staging_for_tests(const StagingForTests& s) {
  std::lock_guard<std::mutex> lock(hook_mu);
  hook = s;
  hook_cpu.store(s.cpu);
  hook_strided.store(s.strided);
}

size_t staged_buffers_for_tests() { return staged_count.load(); }
size_t staged_peak_bytes_for_tests() { return staged_peak_bytes.load(); }
void reset_staged_peak_for_tests() { staged_peak_bytes.store(staged_live_bytes.load()); }

std::vector<ByteRange> ascending_pieces(size_t begin, size_t n, size_t piece) {
  std::vector<ByteRange> order;
  for (size_t b = 0; b < n; b += piece)
    order.push_back({begin + b, begin + std::min(n, b + piece)});
  return order;
}

at::Tensor flat_bytes(const at::Tensor& t) {
  // Not reshape: an empty tensor (or one of size-1 dimensions) counts as contiguous whatever its
  // strides, and viewing bytes wants a stride of 1.
  return t.as_strided({t.numel()}, {1}).view(at::kByte);
}

std::vector<at::Tensor> element_range(const std::vector<at::Tensor>& ts, size_t begin, size_t end) {
  std::vector<at::Tensor> out;
  size_t offset = 0;
  for (const at::Tensor& t : ts) {
    const auto n = static_cast<size_t>(t.numel());
    const size_t lo = std::max(begin, offset), hi = std::min(end, offset + n);
    if (lo < hi) {
      out.push_back(t.reshape({-1}).narrow(0, static_cast<int64_t>(lo - offset),
                                           static_cast<int64_t>(hi - lo)));
    }
    offset += n;
  }
  return out;
}

std::shared_ptr<const IssueMark> StagedTensors::mark_issue(const std::vector<at::Tensor>& ts) {
  const c10::Device dev = ts.front().device();
  if (!dev.is_cuda()) return nullptr;
  return std::make_shared<IssueMark>(dev);
}

bool StagedTensors::wanted(at::ArrayRef<at::Tensor> ts, int size, size_t piece_bytes,
                           bool once_dense) {
  if (size < 2 || ts.empty() || piece_bytes == 0) return false;
  const c10::Device dev = ts.front().device();
  if (dev.is_cpu() ? !hook_cpu.load(std::memory_order_relaxed) : !dev.is_cuda()) return false;
  if (dev.is_cpu() && !hook_strided.load(std::memory_order_relaxed)) once_dense = false;
  size_t bytes = 0;
  for (const at::Tensor& t : ts) {
    if (t.device() != dev || (!once_dense && !dense(t))) return false;
    bytes += t.nbytes();
  }
  return bytes >= 2 * piece_bytes;
}

bool StagedTensors::may_stage(const at::Tensor& t) {
  const c10::Device dev = t.device();
  return dev.is_cpu() ? hook_cpu.load(std::memory_order_relaxed) : dev.is_cuda();
}

bool StandIns::wanted(at::ArrayRef<at::Tensor> ts, int size, size_t piece_bytes) {
  return std::any_of(ts.begin(), ts.end(), [](const at::Tensor& t) { return !dense(t); }) &&
         StagedTensors::wanted(ts, size, piece_bytes, /*once_dense=*/true);
}

at::Tensor StandIns::read(const at::Tensor& t) { return contiguous_values(t); }

at::Tensor StandIns::written(const at::Tensor& t) {
  if (dense(t)) return t;
  at::Tensor s = at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  back_.emplace_back(t, s);
  return s;
}

at::Tensor StandIns::updated(const at::Tensor& t) {
  if (dense(t)) return t;
  at::Tensor s = read(t);
  back_.emplace_back(t, s);
  return s;
}

namespace {

template <typename F>
std::vector<at::Tensor> each(const std::vector<at::Tensor>& ts, F&& f) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const at::Tensor& t : ts) out.push_back(f(t));
  return out;
}

}  // namespace

std::vector<at::Tensor> StandIns::read(const std::vector<at::Tensor>& ts) {
  return each(ts, [&](const at::Tensor& t) { return read(t); });
}
std::vector<at::Tensor> StandIns::written(const std::vector<at::Tensor>& ts) {
  return each(ts, [&](const at::Tensor& t) { return written(t); });
}
std::vector<at::Tensor> StandIns::updated(const std::vector<at::Tensor>& ts) {
  return each(ts, [&](const at::Tensor& t) { return updated(t); });
}

void StandIns::copy_back() const {
  for (const auto& [orig, stand_in] : back_) orig.copy_(stand_in);
  if (!back_.empty() && back_.front().first.device().is_cuda()) {
    // Device copies are asynchronous: wait for them.
    const c10::Device dev = back_.front().first.device();
    c10::impl::VirtualGuardImpl(dev.type()).getStream(dev).synchronize();
  }
}

std::shared_ptr<Work> StandIns::finish(const std::shared_ptr<Work>& inner,
                                       Future::Value value) const {
  auto done = inner->future_unobserved()->then([self = *this, value](Future&) {
    self.copy_back();
    return value;
  });
  auto work = std::make_shared<Work>(inner->op(), inner->sequence_number(), done);
  work->set_progress([inner](bool may_run_here) {
    if (!may_run_here) {
      inner->observe();
      return;
    }
    try {
      inner->wait();
    } catch (...) {
      // Its error fails `done` as well, which the caller's wait rethrows.
    }
  });
  return work;
}

std::vector<StagedTensors::Slot> StagedTensors::in_and_out(const std::vector<at::Tensor>& ts) {
  std::vector<Slot> slots;
  for (const at::Tensor& t : ts) slots.push_back(Slot{t, t});
  return slots;
}

StagedTensors::StagedTensors(std::vector<Slot> slots, std::vector<ByteRange> order,
                             size_t piece_bytes, std::shared_ptr<const IssueMark> issue)
    : StagedTensors(host_memory_for(slots), parts_of(slots), either(slots.at(0)).device(),
                    std::move(order), piece_bytes, std::move(issue)) {}

StagedTensors::StagedTensors(at::Tensor host, std::vector<Part> parts, c10::Device dev,
                             std::vector<ByteRange> order, size_t piece_bytes,
                             std::shared_ptr<const IssueMark> issue)
    : Staging(static_cast<const char*>(host.data_ptr()), std::move(order)),
      host_(std::move(host)),
      piece_(piece_bytes) {
  if (dev.is_cuda()) {
    engine_ =
        std::make_unique<DeviceEngine>(std::move(parts), host_, this->order(), issue.get(), dev);
  } else {
    std::memset(data(), 0xff, host_.nbytes());
    engine_ =
        std::make_unique<ThreadEngine>(std::move(parts), host_, this->order(), current_hook());
  }
  // Counted once constructed: the destructor, which uncounts, runs only then.
  staged_count.fetch_add(1);
  const size_t live = staged_live_bytes.fetch_add(host_.nbytes()) + host_.nbytes();
  size_t peak = staged_peak_bytes.load();
  while (live > peak && !staged_peak_bytes.compare_exchange_weak(peak, live)) {}
}

StagedTensors::~StagedTensors() {
  engine_.reset();  // its copies are done before the host buffer counts as free
  staged_live_bytes.fetch_sub(host_.nbytes());
}

bool StagedTensors::arrived(size_t piece) {
  // Pieces arrive in order: remember how far they have.
  while (known_ <= piece) {
    if (!engine_->arrived(known_)) return false;
    ++known_;
  }
  return true;
}

void StagedTensors::finished(size_t begin, size_t end) {
  if (pending_.end == begin && pending_.end > pending_.begin) {
    pending_.end = end;  // the ring finishes each segment's chunks in ascending order
  } else {
    flush();
    pending_ = {begin, end};
  }
  if (pending_.end - pending_.begin >= piece_) flush();
}

void StagedTensors::flush() {
  if (pending_.end > pending_.begin) engine_->copy_out(pending_.begin, pending_.end);
  pending_ = {0, 0};
}

void StagedTensors::complete() {
  flush();
  engine_->drain();
}

}  // namespace tdist::comm::detail
