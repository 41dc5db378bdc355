#pragma once
// Files of the fuzz targets: the seed files they write when TDIST_FUZZ_WRITE_SEEDS is set, and
// the temporary directory a target that reads through a path works in.
#include <stdlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace tdist::fuzz {

// Writes `bytes` to `path`; aborts on failure.
template <class Bytes>
void write_seed(const std::string& path, const Bytes& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) ||
      std::fclose(f) != 0) {
    std::abort();
  }
}

// Writes `first` (the target's selector byte) and then `bytes` to `path`.
template <class Bytes>
void write_seed(const std::string& path, uint8_t first, const Bytes& bytes) {
  std::vector<uint8_t> all{first};
  all.insert(all.end(), bytes.begin(), bytes.end());
  write_seed(path, all);
}

// When TDIST_FUZZ_WRITE_SEEDS names a directory: writes the target's seeds there and exits.
inline void write_seeds_if_asked(void (*write_seeds)(const std::string& dir)) {
  if (const char* dir = std::getenv("TDIST_FUZZ_WRITE_SEEDS")) {
    write_seeds(dir);
    std::exit(0);
  }
}

// A fresh directory $TMPDIR/tdist-<name>-fuzz-XXXXXX (TMPDIR unset: /tmp); aborts on failure.
inline std::string make_temp_dir(const std::string& name) {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/tdist-" + name + "-fuzz-XXXXXX";
  if (!::mkdtemp(templ.data())) std::abort();
  return templ;
}

}  // namespace tdist::fuzz
