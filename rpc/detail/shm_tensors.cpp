#include "tdist/rpc/detail/shm_tensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/rpc/detail/tensor_pool.h"

namespace tdist::rpc::detail {
namespace {

constexpr char kSlotMemfdName[] = "tdist-rpc-slot";
// A slot or stream can neither shrink nor grow: a peer that could shrink one after we mapped it
// would turn our next touch of it into SIGBUS.
constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

struct Header {
  uint64_t magic;
  uint64_t tag;
  uint64_t capacity;
};

std::atomic<int64_t> g_process_slots{0};

struct Hold {
  std::shared_ptr<ShmMappings::Mapping> mapping;
  std::weak_ptr<ReleaseQueue> releases;
  uint64_t tag;
};

void drop_hold(void* ctx) {
  auto* h = static_cast<Hold*>(ctx);
  if (auto q = h->releases.lock()) q->push(h->tag);
  delete h;
}

}  // namespace

struct ShmMappings::Mapping {
  void* base = nullptr;
  size_t length = 0;
  uint64_t capacity = 0;  // from the header, checked against length when mapped
  ~Mapping() {
    if (base) ::munmap(base, length);
  }
};

void ReleaseQueue::push(uint64_t tag) {
  std::lock_guard<std::mutex> lock(mu_);
  tags_.push_back(tag);
}

std::vector<uint64_t> ReleaseQueue::take() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::move(tags_);
}

uint64_t new_shm_tag() {
  uint64_t tag = 0;
  while (tag == 0) {
    if (::getrandom(&tag, sizeof(tag), 0) != sizeof(tag)) tag = 0;
  }
  return tag;
}

std::optional<SealedMemfd> create_sealed_memfd(const char* name, uint64_t bytes) {
  SealedMemfd m;
  m.fd = ::memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (m.fd < 0) return std::nullopt;
  // fallocate reserves the pages now: no shared memory left is an error here, not a SIGBUS at
  // the first touch.
  void* p = MAP_FAILED;
  if (::ftruncate(m.fd, static_cast<off_t>(bytes)) == 0 &&
      ::fallocate(m.fd, 0, 0, static_cast<off_t>(bytes)) == 0 &&
      ::fcntl(m.fd, F_ADD_SEALS, kSeals) == 0) {
    p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, m.fd, 0);
  }
  if (p == MAP_FAILED) {
    const int err = errno;
    ::close(m.fd);
    errno = err;
    return std::nullopt;
  }
  m.base = static_cast<uint8_t*>(p);
  m.bytes = bytes;
  return m;
}

std::optional<PeerMapping> map_peer_memfd(pid_t pid, int fd, const char* name, const char* what,
                                          uint64_t min_bytes, uint64_t max_bytes,
                                          std::string* why) {
  const std::string path = str("/proc/", pid, "/fd/", fd);
  char target[256] = {};
  if (::readlink(path.c_str(), target, sizeof(target) - 1) <= 0) {
    *why = str("cannot see the peer's ", what, " ", path, ": ", std::strerror(errno));
    return std::nullopt;
  }
  // Only a memfd of our name is opened at all (nothing with side effects on open).
  const std::string expected = str("/memfd:", name);
  if (std::strncmp(target, expected.c_str(), expected.size()) != 0) {
    throw ProtocolError(str("peer named descriptor ", fd, " (", target, ") as a ", what));
  }
  const int opened = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (opened < 0) {
    *why = str("cannot open the peer's ", what, " ", path, ": ", std::strerror(errno));
    return std::nullopt;
  }
  struct stat st {};
  if (::fstat(opened, &st) != 0 || !S_ISREG(st.st_mode) ||
      static_cast<uint64_t>(st.st_size) < std::max<uint64_t>(min_bytes, 1)) {
    ::close(opened);
    throw ProtocolError(
        str("peer named descriptor ", fd, " (", target, ") as a ", what, ": not one"));
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    ::close(opened);
    throw ProtocolError(str("peer named descriptor ", fd, " (", target, ") as a ", what, " of ",
                            st.st_size, " bytes, more than the ", max_bytes, " it can need"));
  }
  const int seals = ::fcntl(opened, F_GET_SEALS);
  if (seals < 0 || (seals & kSeals) != kSeals) {
    ::close(opened);
    throw ProtocolError(str("peer named descriptor ", fd, " (", target, ") as a ", what,
                            ": it is not sealed against resizing"));
  }
  PeerMapping m;
  m.length = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, m.length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, opened, 0);
  const int err = errno;
  ::close(opened);
  if (p == MAP_FAILED) {
    *why = str("cannot map the peer's ", what, " ", path, ": ", std::strerror(err));
    return std::nullopt;
  }
  m.base = p;
  return m;
}

ShmSlots::~ShmSlots() {
  for (auto& [tag, s] : slots_) destroy(s);
}

int64_t ShmSlots::process_slots() { return g_process_slots.load(); }

void ShmSlots::destroy(Slot& s) {
  if (s.base) ::munmap(s.base, s.mapped);
  if (s.fd >= 0) {
    ::close(s.fd);
    g_process_slots.fetch_sub(1);
  }
  s.base = nullptr;
  s.fd = -1;
}

bool ShmSlots::make_room(uint64_t mapped) {
  for (;;) {
    if (held_ + mapped <= cap_) {
      if (g_process_slots.fetch_add(1) < kMaxProcessSlots) return true;  // reserved
      g_process_slots.fetch_sub(1);
    }
    auto oldest = slots_.end();
    for (auto it = slots_.begin(); it != slots_.end(); ++it) {
      if (!it->second.busy &&
          (oldest == slots_.end() || it->second.last_use < oldest->second.last_use)) {
        oldest = it;
      }
    }
    if (oldest == slots_.end()) return false;
    held_ -= oldest->second.mapped;
    retired_.push_back(oldest->first);
    destroy(oldest->second);
    slots_.erase(oldest);
  }
}

std::optional<ShmSlots::Put> ShmSlots::put(const void* src, uint64_t bytes) {
  uint8_t* data = nullptr;
  Put out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Slot* best = nullptr;
    uint64_t best_tag = 0;
    for (auto& [tag, s] : slots_) {
      if (!s.busy && s.capacity >= bytes && s.capacity / 2 <= bytes &&
          (!best || s.capacity < best->capacity)) {
        best = &s;
        best_tag = tag;
      }
    }
    if (!best) {
      const uint64_t capacity = page_rounded(bytes);
      const uint64_t mapped = kShmHeaderBytes + capacity;
      if (!make_room(mapped)) return std::nullopt;
      Slot s;
      s.capacity = capacity;
      s.mapped = mapped;
      std::optional<SealedMemfd> m = create_sealed_memfd(kSlotMemfdName, mapped);
      if (!m) {
        TDIST_LOG_DEBUG("rpc: no shared-memory slot of ", mapped, " bytes: ", std::strerror(errno));
        g_process_slots.fetch_sub(1);
        return std::nullopt;
      }
      s.fd = m->fd;
      s.base = m->base;
      best_tag = new_shm_tag();
      const Header h{kShmSlotMagic, best_tag, capacity};
      std::memcpy(s.base, &h, sizeof(h));
      held_ += mapped;
      best = &slots_.emplace(best_tag, s).first->second;
    }
    best->busy = true;
    best->last_use = ++clock_;
    data = best->base + kShmHeaderBytes;
    out.ref.fd = best->fd;
    out.ref.tag = best_tag;
    out.address = reinterpret_cast<uint64_t>(data);
  }
  // Busy: nobody else touches it until the receiver releases it.
  if (bytes) {
    parallel_copy(bytes, [&](uint64_t off, uint64_t n) {
      std::memcpy(data + off, static_cast<const uint8_t*>(src) + off, n);
    });
  }
  return out;
}

bool ShmSlots::release(uint64_t tag) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(tag);
  if (it == slots_.end() || !it->second.busy) return false;
  it->second.busy = false;
  return true;
}

std::vector<uint64_t> ShmSlots::take_retired(size_t max) {
  std::lock_guard<std::mutex> lock(mu_);
  if (retired_.size() <= max) return std::move(retired_);
  std::vector<uint64_t> out(retired_.begin(), retired_.begin() + static_cast<ptrdiff_t>(max));
  retired_.erase(retired_.begin(), retired_.begin() + static_cast<ptrdiff_t>(max));
  return out;
}

void ShmSlots::untake_retired(const std::vector<uint64_t>& tags) {
  std::lock_guard<std::mutex> lock(mu_);
  retired_.insert(retired_.end(), tags.begin(), tags.end());
}

uint64_t ShmSlots::bytes_held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

size_t ShmSlots::busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [tag, s] : slots_) n += s.busy ? 1 : 0;
  return n;
}

std::optional<at::Tensor> ShmMappings::tensor(pid_t pid, const ShmRef& ref, const TensorMeta& meta,
                                              const std::shared_ptr<ReleaseQueue>& releases) {
  if (disabled_) return std::nullopt;
  auto it = maps_.find(ref.tag);
  if (it == maps_.end()) {
    if (maps_.size() >= kMaxShmMappings) {
      throw ProtocolError(
          str("peer names more than ", kMaxShmMappings, " shared-memory slots at once"));
    }
    std::string why;
    // The sender made this slot for this tensor or one at most twice as large (ShmSlots::put
    // reuses a slot for at least half its capacity): nothing larger is mapped.
    const uint64_t most = std::min<uint64_t>(meta.nbytes, uint64_t{1} << 61);
    std::optional<PeerMapping> p =
        map_peer_memfd(pid, ref.fd, kSlotMemfdName, "shared-memory slot", kShmHeaderBytes,
                       kShmHeaderBytes + page_rounded(2 * most + 1), &why);
    if (!p) {
      TDIST_LOG_DEBUG("rpc: ", why, "; reading its tensors with process_vm_readv");
      disabled_ = true;
      return std::nullopt;
    }
    auto m = std::make_shared<Mapping>();
    m->base = p->base;
    m->length = p->length;
    Header h{};
    std::memcpy(&h, m->base, sizeof(h));
    if (h.magic != kShmSlotMagic || h.tag != ref.tag || h.capacity > m->length - kShmHeaderBytes) {
      throw ProtocolError(str("peer's shared-memory slot ", ref.fd,
                              " has a header that does not "
                              "match the frame (tag, magic or capacity)"));
    }
    m->capacity = h.capacity;
    it = maps_.emplace(ref.tag, std::move(m)).first;
  }
  const auto& m = it->second;
  if (meta.nbytes > m->capacity) {
    throw ProtocolError(str("peer put a tensor of ", meta.nbytes,
                            " bytes in a shared-memory "
                            "slot of ",
                            m->capacity));
  }
  auto* hold = new Hold{m, releases, ref.tag};
  c10::DataPtr data(static_cast<uint8_t*>(m->base) + kShmHeaderBytes, hold, &drop_hold,
                    c10::Device(c10::DeviceType::CPU));
  return tensor_on_data(std::move(data), meta);
}

}  // namespace tdist::rpc::detail
