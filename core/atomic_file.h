#pragma once
// Files written whole or not at all, and their digests: what tdist-train's checkpoints and
// fsdp's sharded checkpoints and safetensors files share (Reliability rules: a checkpoint is
// written to a temporary file, flushed and renamed).
//
// write_file_atomically: a new temporary file in the target's directory (never one planted at
// that name: O_EXCL | O_NOFOLLOW), readable and writable by its owner only (0600), written,
// fsync'ed, renamed over the target, and the directory fsync'ed. A crash at any moment leaves the previous file or the new one, never a torn one.
// Temporary files that an interrupted write left (same target, another process) are removed
// first.
//
// Plain functions, blocking (file I/O), thread safe for distinct targets.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tdist {

// Writes the concatenation of `pieces` to `path` atomically (see above). Creates the parent
// directory if needed. Throws Error naming the file on any I/O failure (the previous file, if
// any, stays).
void write_file_atomically(const std::string& path, const std::vector<std::string_view>& pieces);

// A directory for files that only this user may plant or replace (checkpoints): when it does not
// exist and `create`, it is made with mode 0700 (missing parents as mkdir -p would). Then it must
// be a directory itself, not a symbolic link to one (lstat), owned by this user (the effective
// uid), and writable by neither group nor others. Returns false when it does not exist and not
// `create`; throws InvalidArgument naming the directory, its owner or its mode otherwise.
bool check_private_directory(const std::string& dir, bool create);

// The whole file, or nullopt when it does not exist. Throws Error naming the file when it
// cannot be read, or is larger than max_bytes.
std::optional<std::vector<char>> read_file(const std::string& path,
                                           uint64_t max_bytes = UINT64_MAX);

// Reads exactly `size` bytes at `offset` of the open file `fd` (named `path` in errors) into
// `out`; throws Error when the file ends before (a truncated file) or a read fails.
void read_exactly_at(int fd, void* out, size_t size, uint64_t offset, const std::string& path);

using Sha256Digest = std::array<uint8_t, 32>;
Sha256Digest sha256(const void* data, size_t size);
// Incremental SHA-256 (a file read in pieces).
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, size_t size);
  Sha256Digest finish();

 private:
  void* ctx_;  // EVP_MD_CTX
};
std::string to_hex(const Sha256Digest& d);

}  // namespace tdist
