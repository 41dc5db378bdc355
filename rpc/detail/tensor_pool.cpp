#include "tdist/rpc/detail/tensor_pool.h"

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/Storage.h>
#include <sys/mman.h>
#include <unistd.h>

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
  size_t mapped = 0;  // the length of its mmap()ed region; 0: from posix_memalign
};

void free_block(const Block& b) {
  if (b.mapped) {
    ::munmap(b.ptr, b.mapped);
  } else {
    std::free(b.ptr);
  }
}

class CachingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    Block b = take(n);
    if (!b.ptr) {
      if (::posix_memalign(&b.ptr, kAlignment, std::max<size_t>(n, 1)) != 0) {
        throw std::bad_alloc();
      }
      b.size = n;
    }
    return adopt(b);
  }
  // A cached block of exactly n bytes, or an empty DataPtr.
  c10::DataPtr cached(size_t n) {
    Block b = take(n);
    return b.ptr ? adopt(b) : c10::DataPtr();
  }
  // Storage in `b` (an mmap()ed region from receive_tensor, or one of ours).
  c10::DataPtr adopt(const Block& b) {
    return {b.ptr, new Block(b), &CachingAllocator::release, c10::Device(c10::DeviceType::CPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count) std::memcpy(dest, src, count);
  }

 private:
  static void release(void* ctx);
  // A cached block of exactly n bytes (ptr == nullptr: none).
  Block take(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(n);
    if (it == free_.end()) return Block{nullptr, 0};
    Block b = it->second;
    free_.erase(it);
    cached_ -= n;
    return b;
  }
  void give(Block b) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (b.size >= kMinCached && cached_ + b.size <= kMaxCachedBytes) {
        free_.emplace(b.size, b);
        cached_ += b.size;
        return;
      }
    }
    free_block(b);
  }

  std::mutex mu_;
  std::multimap<size_t, Block> free_;  // guarded by mu_
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

at::Tensor tensor_on(c10::Storage storage, const TensorMeta& meta) {
  std::vector<int64_t> strides(meta.shape.size());
  int64_t stride = 1;
  for (size_t i = meta.shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= std::max<int64_t>(meta.shape[i], 1);
  }
  const auto dtype = static_cast<c10::ScalarType>(meta.dtype);
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, meta.shape, strides);
}

c10::Storage storage_of(c10::DataPtr data, size_t nbytes) {
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), &allocator(),
                      /*resizable=*/true);
}

void* map_or_throw(void* old, size_t old_len, size_t len) {
  void* p = old ? ::mremap(old, old_len, len, MREMAP_MAYMOVE)
                : ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  return p;
}

}  // namespace

size_t page_rounded(uint64_t n) {
  static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return static_cast<size_t>((n + page - 1) / page * page);
}

at::Tensor empty_for_receive(const TensorMeta& meta) {
  const auto dtype = static_cast<c10::ScalarType>(meta.dtype);
  if (meta.nbytes < kMinCached) return at::empty(meta.shape, at::TensorOptions().dtype(dtype));
  return tensor_on(c10::Storage(c10::Storage::use_byte_size_t(), meta.nbytes, &allocator(),
                                /*resizable=*/true),
                   meta);
}

at::Tensor tensor_on_data(c10::DataPtr data, const TensorMeta& meta) {
  return tensor_on(storage_of(std::move(data), meta.nbytes), meta);
}

at::Tensor receive_tensor(const TensorMeta& meta,
                          const std::function<void(void* dst, size_t size)>& read) {
  const uint64_t n = meta.nbytes;
  if (n < kMinCached) {
    at::Tensor t = empty_for_receive(meta);
    if (n) read(t.data_ptr(), n);
    return t;
  }
  if (c10::DataPtr block = allocator().cached(n)) {
    at::Tensor t = tensor_on(storage_of(std::move(block), n), meta);
    read(t.data_ptr(), n);
    return t;
  }
  // Grows with what arrived: each mapping is at most twice the bytes read into it so far (plus
  // the first chunk).
  const size_t full = page_rounded(n);
  size_t mapped = std::min(full, page_rounded(kFirstReceiveChunk));
  void* p = map_or_throw(nullptr, 0, mapped);
  uint64_t got = 0;
  try {
    for (;;) {
      const uint64_t until = std::min<uint64_t>(n, mapped);
      read(static_cast<uint8_t*>(p) + got, until - got);
      got = until;
      if (got == n) break;
      const size_t bigger = std::min(full, mapped * 2);
      p = map_or_throw(p, mapped, bigger);
      mapped = bigger;
    }
  } catch (...) {
    ::munmap(p, mapped);
    throw;
  }
  return tensor_on(storage_of(allocator().adopt(Block{p, n, mapped}), n), meta);
}

void parallel_copy(uint64_t total, const std::function<void(uint64_t, uint64_t)>& copy) {
  auto& helpers = CopyHelpers::instance();
  const uint64_t parts =
      std::min<uint64_t>(helpers.size() + 1, std::max<uint64_t>(1, total / kChunk));
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
  for (uint64_t off = 0; off < total; off += per)
    chunks.emplace_back(off, std::min(per, total - off));
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
