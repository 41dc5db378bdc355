#include "tdist/core/process_memory.h"

#include <errno.h>
#include <sys/uio.h>

#include <cstring>
#include <random>

#include "tdist/core/error.h"

namespace tdist {
namespace {

uint64_t random_nonzero() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (uint64_t(rd()) << 32) ^ rd();
  return v;
}

// process_vm_readv or process_vm_writev until every byte moved.
template <typename Call>
int move_all(uint8_t* local_base, uint64_t address, size_t size, Call call) noexcept {
  size_t done = 0;
  while (done < size) {
    struct iovec local = {local_base + done, size - done};
    struct iovec remote = {reinterpret_cast<void*>(address + done), size - done};
    ssize_t n = call(&local, &remote);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EFAULT;
    done += static_cast<size_t>(n);
  }
  return 0;
}

}  // namespace

int try_read_process_memory(pid_t pid, uint64_t address, void* out, size_t size) noexcept {
  return move_all(static_cast<uint8_t*>(out), address, size, [pid](iovec* local, iovec* remote) {
    return ::process_vm_readv(pid, local, 1, remote, 1, 0);
  });
}

int try_write_process_memory(pid_t pid, uint64_t address, const void* in, size_t size) noexcept {
  auto* src = const_cast<uint8_t*>(static_cast<const uint8_t*>(in));  // only read
  return move_all(src, address, size, [pid](iovec* local, iovec* remote) {
    return ::process_vm_writev(pid, local, 1, remote, 1, 0);
  });
}

void read_process_memory(pid_t pid, uint64_t address, void* out, size_t size) {
  if (int err = try_read_process_memory(pid, address, out, size)) {
    throw NetworkError(str("cannot read ", size, " bytes of process ", pid, " memory: ",
                           std::strerror(err)));
  }
}

ProcessCanary process_canary() {
  static const uint64_t value = random_nonzero();
  return ProcessCanary{reinterpret_cast<uint64_t>(&value), value};
}

bool can_read_process(pid_t pid, const ProcessCanary& canary) {
  if (pid <= 0 || canary.value == 0) return false;
  uint64_t seen = 0;
  return try_read_process_memory(pid, canary.address, &seen, sizeof(seen)) == 0 &&
         seen == canary.value;
}

}  // namespace tdist
