#include "tdist/rpc/detail/tensor_pool.h"

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/Storage.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "tdist/core/error.h"

namespace tdist::rpc::detail {
namespace {

constexpr size_t kAlignment = 64;
constexpr uint64_t kChunk = uint64_t{4} << 20;  // parallel_copy's smallest chunk

struct Block {
  void* ptr;
  size_t size;
};

class CachingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* p = take(n);
    if (!p) {
      if (::posix_memalign(&p, kAlignment, std::max<size_t>(n, 1)) != 0) {
        throw std::bad_alloc();
      }
    }
    return {p, new Block{p, n}, &CachingAllocator::release, c10::Device(c10::DeviceType::CPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count) std::memcpy(dest, src, count);
  }

 private:
  static void release(void* ctx);
  void* take(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(n);
    if (it == free_.end()) return nullptr;
    void* p = it->second;
    free_.erase(it);
    cached_ -= n;
    return p;
  }
  void give(Block b) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (b.size >= kMinCached && cached_ + b.size <= kMaxCachedBytes) {
        free_.emplace(b.size, b.ptr);
        cached_ += b.size;
        return;
      }
    }
    std::free(b.ptr);
  }

  std::mutex mu_;
  std::multimap<size_t, void*> free_;  // guarded by mu_
  size_t cached_ = 0;                  // guarded by mu_
  friend CachingAllocator& allocator();
};

CachingAllocator& allocator() {
  static auto* a = new CachingAllocator();  // never destroyed: tensors may outlive statics
  return *a;
}

void CachingAllocator::release(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  allocator().give(*b);
  delete b;
}

class CopyHelpers {
 public:
  static CopyHelpers& instance() {
    static auto* h = new CopyHelpers();  // threads never joined: they only ever wait for work
    return *h;
  }
  size_t size() const { return threads_; }
  void post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  CopyHelpers() {
    unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    threads_ = std::min<size_t>(hw > 1 ? hw - 1 : 1, 3);
    for (size_t i = 0; i < threads_; ++i) std::thread([this] { run(); }).detach();
  }
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !tasks_.empty(); });
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  size_t threads_ = 1;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
};

}  // namespace

at::Tensor empty_for_receive(const TensorMeta& meta) {
  const auto dtype = static_cast<c10::ScalarType>(meta.dtype);
  if (meta.nbytes < kMinCached) return at::empty(meta.shape, at::TensorOptions().dtype(dtype));
  c10::Storage storage(c10::Storage::use_byte_size_t(), meta.nbytes, &allocator(),
                       /*resizable=*/true);
  std::vector<int64_t> strides(meta.shape.size());
  int64_t stride = 1;
  for (size_t i = meta.shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= std::max<int64_t>(meta.shape[i], 1);
  }
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, meta.shape, strides);
}

void parallel_copy(uint64_t total, const std::function<void(uint64_t, uint64_t)>& copy) {
  auto& helpers = CopyHelpers::instance();
  const uint64_t parts = std::min<uint64_t>(helpers.size() + 1, std::max<uint64_t>(1, total / kChunk));
  if (parts <= 1) {
    copy(0, total);
    return;
  }
  const uint64_t per = (total / parts + 4095) & ~uint64_t{4095};
  std::mutex mu;
  std::condition_variable cv;
  size_t left = 0;
  std::exception_ptr error;
  auto run = [&](uint64_t off, uint64_t n) {
    std::exception_ptr e;
    try {
      copy(off, n);
    } catch (...) {
      e = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mu);
    if (e && !error) error = e;
    if (--left == 0) cv.notify_all();
  };
  std::vector<std::pair<uint64_t, uint64_t>> chunks;
  for (uint64_t off = 0; off < total; off += per) chunks.emplace_back(off, std::min(per, total - off));
  left = chunks.size();
  for (size_t i = 1; i < chunks.size(); ++i) {
    helpers.post([&run, c = chunks[i]] { run(c.first, c.second); });
  }
  run(chunks[0].first, chunks[0].second);
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return left == 0; });
  if (error) std::rethrow_exception(error);
}

}  // namespace tdist::rpc::detail
