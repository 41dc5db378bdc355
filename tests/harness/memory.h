#pragma once
// This process's memory, from /proc/self/status, for tests that bound what a peer can make us
// hold. Each returns -1 where /proc is not there (the test then skips its check).
//   peak_rss_kib(reset): VmHWM, the peak resident set; with reset, cleared first
//                        (/proc/self/clear_refs "5") and read back at once.
//   vm_size_kib():       VmSize, the address space held now. Memory allocated but not yet
//                        touched (a large malloc) shows here and not in the resident set.
#include <cstdio>
#include <string_view>

namespace tdist::test {

inline long status_kib(const char* field) {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  char name[64];
  long kib = -1;
  long value = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "%63[^:]: %ld kB", name, &value) == 2 &&
        std::string_view(name) == field) {
      kib = value;
      break;
    }
  }
  std::fclose(f);
  return kib;
}

inline long peak_rss_kib(bool reset) {
  if (reset) {
    FILE* f = std::fopen("/proc/self/clear_refs", "w");
    if (f == nullptr) return -1;
    std::fputs("5", f);  // 5: reset the peak resident set size
    std::fclose(f);
  }
  return status_kib("VmHWM");
}

inline long vm_size_kib() { return status_kib("VmSize"); }

}  // namespace tdist::test
