#include "tdist/core/cpu_memory.h"

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>

#include "tdist/core/error.h"

namespace tdist {
namespace {

// Each allocation is kHeader bytes longer than asked: its size is written in front of the data,
// so the deleter (which gets only the data pointer) knows what to subtract. 64 keeps the data as
// aligned as libtorch's CPU allocator aligns it.
constexpr size_t kHeader = 64;

std::atomic<int64_t> g_allocated{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_allocations{0};
std::atomic<bool> g_tracked{false};
// The wrapped allocator's raw deleter: constant once installed (before any counted allocation).
c10::DeleterFnPtr g_base_deleter = nullptr;

void raise_peak(int64_t now) {
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {}
}

void counted_delete(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  const auto bytes = *reinterpret_cast<const size_t*>(base);
  g_allocated.fetch_sub(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  g_base_deleter(base);
}

class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) return {nullptr, nullptr, &counted_delete, cpu};
    char* base = static_cast<char*>(base_->raw_allocate(n + kHeader));
    *reinterpret_cast<size_t*>(base) = n;
    char* data = base + kHeader;
    g_allocations.fetch_add(1, std::memory_order_relaxed);
    raise_peak(g_allocated.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) +
               static_cast<int64_t>(n));
    return {data, data, &counted_delete, cpu};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  c10::Allocator* const base_;
};

}  // namespace

void track_cpu_memory() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::Allocator* base = c10::GetCPUAllocator();
    TDIST_CHECK(base != nullptr && base->raw_deleter() != nullptr,
                "track_cpu_memory: libtorch's CPU allocator hands out no raw memory (no raw "
                "deleter), which the counting allocator wraps");
    g_base_deleter = base->raw_deleter();
    // Never freed: tensors it allocated may outlive every static destructor.
    static auto* counting = new CountingCpuAllocator(base);
    // Above the default allocator's priority (0), so that it replaces it.
    c10::SetCPUAllocator(counting, /*priority=*/100);
    g_tracked.store(true);
  });
}

bool cpu_memory_tracked() { return g_tracked.load(); }

CpuMemoryStats cpu_memory_stats() {
  CpuMemoryStats s;
  s.allocated_bytes = g_allocated.load(std::memory_order_relaxed);
  s.peak_bytes = g_peak.load(std::memory_order_relaxed);
  s.allocations = g_allocations.load(std::memory_order_relaxed);
  return s;
}

void count_other_cpu_memory(int64_t bytes) {
  if (!g_tracked.load(std::memory_order_relaxed)) return;
  const int64_t now = g_allocated.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  if (bytes > 0) {
    g_allocations.fetch_add(1, std::memory_order_relaxed);
    raise_peak(now);
  }
}

void reset_peak_cpu_memory() {
  g_peak.store(g_allocated.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // namespace tdist
