#include "tdist/core/atomic_file.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "tdist/core/error.h"

namespace tdist {
namespace {

void write_all(int fd, const char* data, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) TDIST_THROW(Error, "cannot write '", path, "': ", std::strerror(errno));
    data += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

void write_file_atomically(const std::string& path, const std::vector<std::string_view>& pieces) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) TDIST_THROW(Error, "cannot create directory '", dir.string(), "': ", ec.message());

  // Temporary files of writes that were interrupted (the process was killed) are garbage.
  const std::string tmp_prefix = target.filename().string() + ".tmp.";
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.path().filename().string().rfind(tmp_prefix, 0) == 0) fs::remove(entry.path(), ec);
  }
  const std::string tmp_path = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) TDIST_THROW(Error, "cannot create '", tmp_path, "': ", std::strerror(errno));
  try {
    for (std::string_view p : pieces) write_all(fd, p.data(), p.size(), tmp_path);
    if (::fsync(fd) != 0)
      TDIST_THROW(Error, "cannot fsync '", tmp_path, "': ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp_path.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp_path.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp_path.c_str());
    TDIST_THROW(Error, "cannot rename '", tmp_path, "' to '", path, "': ", std::strerror(err));
  }
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // best effort: the rename is durable once the directory is
    ::close(dfd);
  }
}

bool check_private_directory(const std::string& dir_in, bool create) {
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();  // "d/" would follow a link
  TDIST_CHECK_ARG(!dir.empty(), "an empty directory name");
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT) TDIST_THROW(Error, "cannot stat '", dir, "': ", std::strerror(errno));
    if (!create) return false;
    const std::filesystem::path path(dir);
    std::error_code ec;
    if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
    if (ec)
      TDIST_THROW(Error, "cannot create directory '", path.parent_path().string(),
                  "': ", ec.message());
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
      TDIST_THROW(Error, "cannot create directory '", dir, "': ", std::strerror(errno));
    }
    if (::lstat(dir.c_str(), &st) != 0) {
      TDIST_THROW(Error, "cannot stat '", dir, "': ", std::strerror(errno));
    }
  }
  TDIST_CHECK_ARG(!S_ISLNK(st.st_mode), "'", dir,
                  "' is a symbolic link: give the directory "
                  "itself (a link could be turned to another directory between two writes)");
  TDIST_CHECK_ARG(S_ISDIR(st.st_mode), "'", dir, "' is not a directory");
  TDIST_CHECK_ARG(st.st_uid == ::geteuid(), "the directory '", dir, "' belongs to uid ", st.st_uid,
                  ", not to this user (uid ", ::geteuid(),
                  "): its owner could "
                  "replace what is written there");
  if ((st.st_mode & 022) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    TDIST_THROW(InvalidArgument, "the directory '", dir, "' has mode ", mode,
                ": group or others "
                "can write it, so they could replace what is written there (chmod go-w '",
                dir, "')");
  }
  return true;
}

std::optional<std::vector<char>> read_file(const std::string& path, uint64_t max_bytes) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return std::nullopt;
    TDIST_THROW(Error, "cannot open '", path, "': ", std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    TDIST_THROW(Error, "cannot stat '", path, "': ", std::strerror(err));
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes) {
    ::close(fd);
    TDIST_THROW(Error, "'", path, "' has ", size, " bytes, more than the ", max_bytes,
                " it may have");
  }
  std::vector<char> bytes(static_cast<size_t>(size));
  try {
    read_exactly_at(fd, bytes.data(), bytes.size(), 0, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return bytes;
}

void read_exactly_at(int fd, void* out, size_t size, uint64_t offset, const std::string& path) {
  auto* p = static_cast<char*>(out);
  while (size > 0) {
    ssize_t r = ::pread(fd, p, size, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) TDIST_THROW(Error, "cannot read '", path, "': ", std::strerror(errno));
    if (r == 0) {
      TDIST_THROW(Error, "'", path, "' ends at byte ", offset, ", before the ", size,
                  " more bytes expected there (a truncated file)");
    }
    p += r;
    offset += static_cast<uint64_t>(r);
    size -= static_cast<size_t>(r);
  }
}

Sha256Digest sha256(const void* data, size_t size) {
  Sha256 h;
  h.update(data, size);
  return h.finish();
}

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  TDIST_CHECK(ctx_ != nullptr &&
                  EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_sha256(), nullptr) == 1,
              "SHA-256 failed");
}

Sha256::~Sha256() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }

void Sha256::update(const void* data, size_t size) {
  TDIST_CHECK(EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), data, size) == 1, "SHA-256 failed");
}

Sha256Digest Sha256::finish() {
  Sha256Digest out{};
  unsigned int len = 0;
  TDIST_CHECK(EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), out.data(), &len) == 1 &&
                  len == out.size(),
              "SHA-256 failed");
  return out;
}

std::string to_hex(const Sha256Digest& d) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s;
  for (uint8_t b : d) {
    s.push_back(kHex[b >> 4]);
    s.push_back(kHex[b & 15]);
  }
  return s;
}

}  // namespace tdist
