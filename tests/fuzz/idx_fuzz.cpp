// Fuzzes tdist-train's IDX reader (apps/train/idx.h), plain and gzip-compressed, through a file
// as it reads one. The first byte picks the number of dimensions asked for (bits 0-1: 1 to 4)
// and the file (bits 2-3): 0 the rest of the input as a plain file; 1 the rest as a .gz file (a
// corrupt gzip stream, mostly); 2 the rest gzip-compressed here into a .gz file (a sound stream
// of fuzzed IDX bytes). Where the rest is the file's content, a tensor read must hold its
// last bytes. Any input must give a tensor of the declared shape or a DataError, never
// a crash, a sanitizer report or an allocation larger than the file (or, for gzip, than deflate's
// largest expansion of it) allows.
#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "apps/train/idx.h"
#include "tests/fuzz/fuzz_files.h"

namespace {

std::string g_dir;

void write_file(const std::string& path, const uint8_t* data, size_t size) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || (size && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) std::abort();
}

// The gzip file (one member) that gzip(1) would write for these bytes.
std::vector<uint8_t> gzip(const uint8_t* data, size_t size) {
  z_stream zs{};
  if (deflateInit2(&zs, Z_BEST_SPEED, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) != Z_OK) {
    std::abort();
  }
  std::vector<uint8_t> out(deflateBound(&zs, size));
  zs.next_in = const_cast<uint8_t*>(data);
  zs.avail_in = static_cast<uInt>(size);
  zs.next_out = out.data();
  zs.avail_out = static_cast<uInt>(out.size());
  if (deflate(&zs, Z_FINISH) != Z_STREAM_END) std::abort();
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_dir = tdist::fuzz::make_temp_dir("idx");
  std::atexit([] {
    ::unlink((g_dir + "/data").c_str());
    ::unlink((g_dir + "/data.gz").c_str());
    ::rmdir(g_dir.c_str());
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int ndim = 1 + (data[0] & 3);
  const int file = (data[0] >> 2) & 3;
  ++data;
  --size;
  std::string path = g_dir + "/data";
  if (file == 0) {
    write_file(path, data, size);
  } else {
    path += ".gz";
    if (file == 1) {
      write_file(path, data, size);
    } else {
      const std::vector<uint8_t> z = gzip(data, size);
      write_file(path, z.data(), z.size());
    }
  }
  try {
    const at::Tensor t = tdist::train::read_idx_ubyte(path, ndim);
    if (t.dim() != ndim || t.scalar_type() != at::kByte) std::abort();
    // Where the rest of the input is the IDX file's content, the elements are its last bytes.
    const size_t n = static_cast<size_t>(t.numel());
    if (file != 1 && (4 + 4 * size_t(ndim) + n != size ||
                      (n && std::memcmp(t.data_ptr(), data + size - n, n) != 0))) {
      std::abort();
    }
  } catch (const tdist::train::DataError&) {}
  return 0;
}
