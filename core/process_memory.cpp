#include "tdist/core/process_memory.h"

#include <errno.h>
#include <sys/uio.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "tdist/core/error.h"

namespace tdist {

// process_vm_readv until every byte moved.
int try_read_process_memory(pid_t pid, uint64_t address, void* out, size_t size) noexcept {
  auto* base = static_cast<uint8_t*>(out);
  size_t done = 0;
  while (done < size) {
    struct iovec local = {base + done, size - done};
    struct iovec remote = {reinterpret_cast<void*>(address + done), size - done};
    ssize_t n = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EFAULT;
    done += static_cast<size_t>(n);
  }
  return 0;
}

void read_process_memory(pid_t pid, uint64_t address, void* out, size_t size) {
  if (int err = try_read_process_memory(pid, address, out, size)) {
    throw NetworkError(
        str("cannot read ", size, " bytes of process ", pid, " memory: ", std::strerror(err)));
  }
}

bool can_read_process(pid_t pid) {
  if (pid <= 0) return false;
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  while (std::getline(maps, line)) {
    uint64_t start = 0, end = 0;
    char perms[8] = {};
    if (std::sscanf(line.c_str(), "%" SCNx64 "-%" SCNx64 " %4s", &start, &end, perms) != 3) {
      continue;
    }
    if (perms[0] != 'r' || end <= start) continue;
    uint8_t byte = 0;
    return try_read_process_memory(pid, start, &byte, 1) == 0;
  }
  return false;
}

}  // namespace tdist
