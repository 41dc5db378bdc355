#include "tdist/core/file_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "tdist/core/detail/store_util.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/wire.h"

// Note [FileStore log]
// ~~~~~~~~~~~~~~~~~~~~
// The file is a sequence of records, each `u64 payload length | payload`, payload being
// `u8 op | string key [| blob value]` (core/wire.h) with op 1 = set, 2 = delete. add() and
// compare_set() are written as the set they amount to, computed under the lock from the state
// the log gives, so they are atomic across processes.
//
// Every operation opens the file, takes flock() (shared for reads, exclusive for writes, both
// polled with LOCK_NB so that the store's timeout bounds the wait), replays the records after
// offset_ into cache_, then (writes only) appends its record at offset_. Records are written
// whole under the exclusive lock, so a reader never sees half of one, except after a writer
// died mid-write: readers then stop at the last whole record, and the next writer truncates the
// torn tail before appending. A file shorter than offset_ was removed and recreated: the cache
// starts over.
//
// Cleanup: each FileStore adds 1 to kRefsKey when built; on destruction it subtracts 1 and adds
// 1 to kFinishedKey. The file is removed by the destructor that brings kFinishedKey to
// num_workers (when num_workers > 0) or kRefsKey to 0 (otherwise), as c10d's FileStore does.
// Keys under kInternalPrefix are not counted by num_keys().

namespace tdist {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint8_t kOpSet = 1;
constexpr uint8_t kOpDelete = 2;
const std::string kInternalPrefix = "__tdist_filestore/";
const std::string kRefsKey = kInternalPrefix + "refs";
const std::string kFinishedKey = kInternalPrefix + "finished";
// The longest a polling get/wait sleeps between looks at the file.
constexpr Millis kMaxPoll{20};

bool is_internal(const std::string& key) { return key.rfind(kInternalPrefix, 0) == 0; }

std::string errno_text() { return std::strerror(errno); }

}  // namespace

// The open, locked file of one operation. Unlocks and closes when destroyed.
class FileStore::LockedFile {
 public:
  LockedFile(const std::string& path, bool exclusive, Millis timeout) : path_(path) {
    // Only this user may read or write the store, and the path itself must be the file: a
    // symbolic link planted there (or a FIFO, a device) is refused, never followed or truncated.
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd_ < 0 && errno == ELOOP) {
      TDIST_THROW(Error, "FileStore refuses '", path,
                  "': it is a symbolic link (the store must be a regular file)");
    }
    if (fd_ < 0) TDIST_THROW(Error, "FileStore cannot open '", path, "': ", errno_text());
    struct stat st {};
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd_);
      TDIST_THROW(Error, "FileStore refuses '", path, "': it is not a regular file");
    }
    // A file someone else made first (a shared directory such as /tmp) is theirs to read and
    // change: refused, never used (root, which could open it, would otherwise share it).
    if (st.st_uid != ::geteuid()) {
      ::close(fd_);
      TDIST_THROW(Error, "FileStore refuses '", path, "': it is owned by uid ", st.st_uid,
                  ", not by this process's uid ", ::geteuid(),
                  " (another user made it first; choose a path of your own)");
    }
    const auto deadline = detail::deadline_after(timeout);
    auto pause = std::chrono::microseconds(100);
    while (::flock(fd_, (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK && errno != EINTR) {
        int err = errno;
        ::close(fd_);
        TDIST_THROW(Error, "FileStore cannot lock '", path, "': ", std::strerror(err));
      }
      if (Clock::now() >= deadline) {
        ::close(fd_);
        TDIST_THROW(TimeoutError, "FileStore at ", path, ": could not lock the file within ",
                    detail::seconds_text(timeout), " s (another process holds it)");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(10000));
    }
  }
  ~LockedFile() {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }
  LockedFile(const LockedFile&) = delete;
  LockedFile& operator=(const LockedFile&) = delete;

  struct Stat {
    uint64_t size = 0;
    uint64_t inode = 0;
  };
  Stat stat() const {
    struct stat st;
    if (::fstat(fd_, &st) != 0)
      TDIST_THROW(Error, "FileStore cannot stat '", path_, "': ", errno_text());
    return {static_cast<uint64_t>(st.st_size), static_cast<uint64_t>(st.st_ino)};
  }

  Bytes read(uint64_t offset, uint64_t size) const {
    Bytes out(size);
    uint64_t done = 0;
    while (done < size) {
      ssize_t n = ::pread(fd_, out.data() + done, size - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) TDIST_THROW(Error, "FileStore cannot read '", path_, "': ", errno_text());
      if (n == 0) break;  // shrank meanwhile (cannot happen under the lock, but be exact)
      done += static_cast<uint64_t>(n);
    }
    out.resize(done);
    return out;
  }

  void write(uint64_t offset, const Bytes& data) {
    uint64_t done = 0;
    while (done < data.size()) {
      ssize_t n =
          ::pwrite(fd_, data.data() + done, data.size() - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) TDIST_THROW(Error, "FileStore cannot write '", path_, "': ", errno_text());
      done += static_cast<uint64_t>(n);
    }
  }

  void truncate(uint64_t size) {
    if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) {
      TDIST_THROW(Error, "FileStore cannot truncate '", path_, "': ", errno_text());
    }
  }

 private:
  const std::string& path_;
  int fd_ = -1;
};

FileStore::FileStore(std::string path, int num_workers, Millis timeout)
    : Store(timeout), path_(std::move(path)), num_workers_(num_workers) {
  TDIST_CHECK_ARG(!path_.empty(), "FileStore needs a file path");
  std::lock_guard<std::mutex> lock(mu_);
  LockedFile file(path_, /*exclusive=*/true, timeout);
  sync(file);
  append_add(file, kRefsKey, 1);
}

FileStore::~FileStore() {
  try {
    std::lock_guard<std::mutex> lock(mu_);
    LockedFile file(path_, /*exclusive=*/true, timeout());
    sync(file);
    const int64_t refs = append_add(file, kRefsKey, -1);
    const int64_t finished = append_add(file, kFinishedKey, 1);
    const bool last = num_workers_ > 0 ? finished >= num_workers_ : refs <= 0;
    // Removed while still locked: whoever opens the path next starts a fresh file.
    if (last && ::unlink(path_.c_str()) != 0 && errno != ENOENT) {
      TDIST_LOG_WARN("FileStore could not remove '", path_, "': ", errno_text());
    }
  } catch (const std::exception& e) {
    TDIST_LOG_WARN("FileStore at ", path_, ": cleanup on destruction failed: ", e.what());
  }
}

void FileStore::sync(LockedFile& file) {
  const LockedFile::Stat st = file.stat();
  if (st.inode != inode_ || st.size < offset_) {
    // A different file than last time (removed and recreated): start over.
    cache_.clear();
    offset_ = 0;
    inode_ = st.inode;
  }
  if (st.size == offset_) return;
  const Bytes tail = file.read(offset_, st.size - offset_);
  wire::Reader r(tail);
  size_t whole = 0;  // bytes of whole records read
  while (r.remaining() >= sizeof(uint64_t)) {
    const uint64_t len = r.u64("record length");
    if (len > r.remaining()) break;  // a torn record (its writer died): stop before it
    wire::Reader rec(r.raw(len, "record"), len);
    try {
      const uint8_t op = rec.u8("op");
      std::string key = rec.string("key");
      if (op == kOpSet) {
        cache_[key] = rec.blob("value");
      } else if (op == kOpDelete) {
        cache_.erase(key);
      } else {
        throw ProtocolError(str("unknown record op ", int(op)));
      }
      rec.expect_end("record");
    } catch (const ProtocolError& e) {
      TDIST_THROW(ProtocolError, "FileStore '", path_, "' is corrupt at byte ", offset_ + whole,
                  ": ", e.what());
    }
    whole = r.position();
  }
  offset_ += whole;
}

void FileStore::append(LockedFile& file, uint8_t op, const std::string& key, const Bytes* value) {
  Bytes payload;
  wire::Writer w(payload);
  w.u8(op);
  w.string(key);
  if (value) w.blob(*value);
  Bytes record;
  wire::Writer(record).blob(payload);
  if (file.stat().size > offset_) file.truncate(offset_);  // drop a torn tail left by a dead writer
  file.write(offset_, record);
  offset_ += record.size();
  if (op == kOpSet) {
    cache_[key] = *value;
  } else {
    cache_.erase(key);
  }
}

int64_t FileStore::append_add(LockedFile& file, const std::string& key, int64_t delta) {
  int64_t value = 0;
  auto it = cache_.find(key);
  if (it != cache_.end()) value = detail::parse_counter(key, it->second);
  if (__builtin_add_overflow(value, delta, &value)) {
    TDIST_THROW(InvalidArgument, "add(", delta, ") overflows the counter in store key '", key, "'");
  }
  const Bytes text = to_bytes(std::to_string(value));
  append(file, kOpSet, key, &text);
  return value;
}

void FileStore::set(const std::string& key, const Bytes& value) {
  std::lock_guard<std::mutex> lock(mu_);
  LockedFile file(path_, true, timeout());
  sync(file);
  append(file, kOpSet, key, &value);
}

Bytes FileStore::get(const std::string& key) {
  Bytes value;
  wait_for({key}, timeout(), &value);
  return value;
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> lock(mu_);
  LockedFile file(path_, true, timeout());
  sync(file);
  return append_add(file, key, delta);
}

Bytes FileStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  std::lock_guard<std::mutex> lock(mu_);
  LockedFile file(path_, true, timeout());
  sync(file);
  auto it = cache_.find(key);
  if (it == cache_.end()) {
    if (!expected.empty()) return expected;
  } else if (it->second != expected) {
    return it->second;
  }
  append(file, kOpSet, key, &desired);
  return desired;
}

void FileStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  wait_for(keys, timeout);
}

void FileStore::wait_for(const std::vector<std::string>& keys, Millis timeout, Bytes* first) {
  const auto deadline = detail::deadline_after(timeout);
  auto pause = Millis(1);
  for (;;) {
    std::vector<std::string> missing;
    {
      std::lock_guard<std::mutex> lock(mu_);
      LockedFile file(path_, false, timeout);
      sync(file);
      for (const auto& k : keys)
        if (!cache_.count(k)) missing.push_back(k);
      if (missing.empty() && first != nullptr) *first = cache_.at(keys.front());
    }
    if (missing.empty()) return;
    const auto now = Clock::now();
    if (now >= deadline) detail::throw_wait_timeout("FileStore at " + path_, missing, timeout);
    std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
    pause = std::min(pause * 2, kMaxPoll);
  }
}

bool FileStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mu_);
  LockedFile file(path_, false, timeout());
  sync(file);
  for (const auto& k : keys)
    if (!cache_.count(k)) return false;
  return true;
}

bool FileStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  LockedFile file(path_, true, timeout());
  sync(file);
  if (!cache_.count(key)) return false;
  append(file, kOpDelete, key, nullptr);
  return true;
}

int64_t FileStore::num_keys() {
  std::lock_guard<std::mutex> lock(mu_);
  LockedFile file(path_, false, timeout());
  sync(file);
  return static_cast<int64_t>(std::count_if(cache_.begin(), cache_.end(),
                                            [](const auto& kv) { return !is_internal(kv.first); }));
}

}  // namespace tdist
