#include "tdist/comm/ring/symmetric_memory.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "tdist/core/cpu_memory.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"

namespace tdist::comm::detail {

// Note [Symmetric memory]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Through the shared-memory ring an allreduce reads 2.5 and writes 2 times its buffer per rank
// at world 2 (docs/perf.md, "Against the memcpy bound"), and process_vm_readv pays a system call
// and a page walk per read. A buffer that every local process of the group has mapped needs
// neither: ProcessGroup::symmetric_empty (PyTorch's symmetric memory, torch.distributed's
// _symmetric_memory.empty and rendezvous in one call) allocates it, collectively, where the
// group may read every peer (Note [Single-copy collectives]):
//   - Each rank makes a memfd of the size asked, sealed against shrinking and growing (so that a
//     peer's mapping of it can never fault) and maps it read-write. The ranks swap the
//     descriptor's number and size (different sizes fail every rank with MismatchError before
//     anything is mapped); each takes each peer's descriptor with pidfd_getfd from the process
//     the kernel named at set-up (SO_PEERCRED), checks its size and seals, and maps it
//     read-only. Taking a descriptor needs the same permission as reading the process's memory,
//     which the group has checked already; no name exists that another process could open. The
//     ranks then swap whether they succeeded, and all return the buffer, or all an undefined
//     tensor (the caller gets plain memory: symmetric_empty never fails for want of sharing).
//   - Every rank numbers its symmetric buffers alike (allocation is collective), so a buffer
//     has one id on every rank. Freeing the tensor drops it on that rank alone; the peers'
//     mappings keep its pages until they free theirs.
//   - An allreduce larger than the group's small size, once any rank's group allocated (the
//     same on every rank), first swaps (id, offset, bytes) with every peer (agree()). When all
//     ranks' buffers lie in one live segment, within its bounds, it runs the mapped allreduce
//     (Note [Mapped allreduce] in algorithms/single_copy.h); otherwise, the ring as before. Each
//     rank decides from the same descriptors, so all decide alike. A group that never allocated
//     pays nothing.
//   - A broadcast of more than the small size does the same with its buffer, and an allgather
//     with this rank's block of its output (in place there by then, whatever the input): in one
//     segment on every rank, each rank copies what it lacks straight from the peers' mappings
//     (broadcast_mapped, allgather_mapped), where the single copy's process_vm_readv pins the
//     peer's pages per call. A reduce-scatter does it with its input, when its blocks lie one
//     after another and its output is elsewhere or this rank's own block: each rank reduces its
//     block of every peer's input into its output (reduce_scatter_mapped), then all meet
//     (RingProcessGroup::agree_mapped is the one test for the four).
// Ranks still only read each other (a peer's mapping is read-only): a rank that resumes late
// cannot write into a buffer its owner went on using.

namespace {

constexpr unsigned kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

size_t round_to_pages(size_t n) {
  const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return (std::max<size_t>(n, 1) + page - 1) / page * page;
}

// Closes a descriptor when it goes out of scope.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// This rank's buffer: an anonymous memfd of `bytes`, sealed, mapped read-write; null and `why`
// on failure.
char* create_own(size_t bytes, Fd* fd, std::string* why) {
  fd->fd = ::memfd_create("tdist-symmetric", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd->fd < 0) {
    *why = str("memfd_create: ", std::strerror(errno));
    return nullptr;
  }
  if (::ftruncate(fd->fd, static_cast<off_t>(bytes)) != 0 ||
      ::fcntl(fd->fd, F_ADD_SEALS, kSeals) != 0) {
    *why = str("sizing or sealing the memfd: ", std::strerror(errno));
    return nullptr;
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd->fd, 0);
  if (p == MAP_FAILED) {
    *why = str("mmap: ", std::strerror(errno));
    return nullptr;
  }
  return static_cast<char*>(p);
}

// Maps process `pid`'s descriptor `theirs` read-only, after checking that it is a sealed memfd
// of `bytes`; null and `why` on failure.
char* map_peer(pid_t pid, int theirs, size_t bytes, std::string* why) {
  Fd pidfd{static_cast<int>(::syscall(SYS_pidfd_open, pid, 0))};
  if (pidfd.fd < 0) {
    *why = str("pidfd_open(", pid, "): ", std::strerror(errno));
    return nullptr;
  }
  Fd fd{static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd.fd, theirs, 0))};
  if (fd.fd < 0) {
    *why = str("pidfd_getfd(", pid, ", ", theirs, "): ", std::strerror(errno));
    return nullptr;
  }
  struct stat st {};
  const int seals = ::fcntl(fd.fd, F_GET_SEALS);
  if (::fstat(fd.fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes || seals < 0 ||
      (static_cast<unsigned>(seals) & kSeals) != kSeals) {
    *why = str("descriptor ", theirs, " of process ", pid, " is not a sealed buffer of ", bytes,
               " bytes");
    return nullptr;
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd.fd, 0);
  if (p == MAP_FAILED) {
    *why = str("mmap of process ", pid, "'s buffer: ", std::strerror(errno));
    return nullptr;
  }
  return static_cast<char*>(p);
}

}  // namespace

SymmetricMemory::Segment::~Segment() {
  for (char* p : maps) {
    if (p != nullptr) ::munmap(p, bytes);
  }
}

at::Tensor SymmetricMemory::allocate(algorithms::Context& c, const std::vector<int64_t>& sizes,
                                     at::ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const size_t bytes = round_to_pages(static_cast<size_t>(numel) * c10::elementSize(dtype));
  auto seg = std::make_shared<Segment>();
  seg->bytes = bytes;
  seg->maps.assign(static_cast<size_t>(c.size), nullptr);
  Fd own;
  std::string why;
  seg->maps[c.rank] = create_own(bytes, &own, &why);
  // Swap (descriptor, bytes); -1: this rank has no buffer to share.
  const int64_t mine[2] = {seg->maps[c.rank] != nullptr ? own.fd : -1, static_cast<int64_t>(bytes)};
  std::vector<int64_t> theirs(2 * static_cast<size_t>(c.size));
  c.ex.swap_with_all(mine, theirs.data(), sizeof(mine));
  for (int p = 0; p < c.size; ++p) {
    if (p != c.rank && theirs[2 * p + 1] != static_cast<int64_t>(bytes)) {
      throw MismatchError(str(c.ex.where(), ": rank ", p, " asked for ", theirs[2 * p + 1],
                              " bytes of symmetric memory (in pages), this rank for ", bytes));
    }
  }
  bool ok = seg->maps[c.rank] != nullptr;
  for (int p = 0; ok && p < c.size; ++p) {
    if (p == c.rank) continue;
    if (theirs[2 * p] < 0) {
      why = str("rank ", p, " could not make its buffer");
      ok = false;
    } else {
      seg->maps[p] = map_peer(state_->pids[p], static_cast<int>(theirs[2 * p]), bytes, &why);
      ok = seg->maps[p] != nullptr;
    }
  }
  // Every rank learns whether every rank mapped everything (and the owners may close their
  // descriptors: nobody takes them any more).
  const uint8_t status = ok ? 1 : 0;
  std::vector<uint8_t> statuses(static_cast<size_t>(c.size));
  c.ex.swap_with_all(&status, statuses.data(), 1);
  statuses[c.rank] = status;
  for (int p = 0; p < c.size; ++p) {
    if (statuses[p] == 0) {
      TDIST_LOG_WARN(c.ex.where(), ": no symmetric memory (plain memory instead): ",
                     ok ? str("rank ", p, " could not map its peers' buffers") : why);
      return {};
    }
  }
  used_ = true;
  seg->id = next_id_++;
  char* base = seg->maps[c.rank];
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->live[reinterpret_cast<uintptr_t>(base)] = seg;
  }
  // The tensor holds the segment (its mappings outlive the group if it does); an operation
  // that found it holds it too, so it is unmapped only when both are done. Its bytes count as a
  // CPU tensor's (core/cpu_memory.h) while it lives.
  const int64_t counted = cpu_memory_tracked() ? numel * c10::elementSize(dtype) : 0;
  count_other_cpu_memory(counted);
  return at::from_blob(
      base, sizes,
      [seg, counted, state = std::weak_ptr<State>(state_)](void* p) mutable {
        if (auto s = state.lock()) {
          std::lock_guard<std::mutex> lock(s->mu);
          s->live.erase(reinterpret_cast<uintptr_t>(p));
        }
        seg.reset();
        count_other_cpu_memory(-counted);
      },
      at::TensorOptions().dtype(dtype));
}

SymmetricMemory::Descriptor SymmetricMemory::describe(const char* data, size_t bytes,
                                                      std::shared_ptr<Segment>* seg) const {
  const auto p = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(state_->mu);
  auto it = state_->live.upper_bound(p);
  if (it == state_->live.begin()) return {};
  --it;
  std::shared_ptr<Segment> found = it->second.lock();
  const uint64_t offset = p - it->first;
  if (!found || offset > found->bytes || bytes > found->bytes - offset) return {};
  *seg = found;
  return {found->id, offset, bytes};
}

bool SymmetricMemory::holds(const char* data, size_t bytes) const {
  std::shared_ptr<Segment> seg;
  return describe(data, bytes, &seg).id != kNone;
}

std::shared_ptr<SymmetricMemory::Segment> SymmetricMemory::agree(
    algorithms::Context& c, char* data, size_t bytes, std::vector<const char*>* buffers) const {
  std::shared_ptr<Segment> seg;
  const Descriptor mine = describe(data, bytes, &seg);
  std::vector<Descriptor> theirs(static_cast<size_t>(c.size));
  c.ex.swap_with_all(&mine, theirs.data(), sizeof(mine));
  theirs[c.rank] = mine;
  // Every rank applies the same rule to the same descriptors. Within bounds: every segment
  // with one id has the same size on every rank (allocate()).
  for (const Descriptor& d : theirs) {
    if (d.id == kNone || d.id != mine.id || d.bytes != bytes) return nullptr;
    if (d.offset > seg->bytes || d.bytes > seg->bytes - d.offset) return nullptr;
  }
  buffers->assign(static_cast<size_t>(c.size), nullptr);
  for (int p = 0; p < c.size; ++p) (*buffers)[p] = seg->maps[p] + theirs[p].offset;
  (*buffers)[c.rank] = data;
  return seg;
}

}  // namespace tdist::comm::detail
