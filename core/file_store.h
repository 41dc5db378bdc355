#pragma once
// FileStore: a Store shared through one file on a file system that all processes see (local
// disk, NFS with working locks). The file is an append-only log of set/add/delete records;
// every operation takes an exclusive flock(), reads the records it has not seen yet, and appends
// its own. get/wait poll the file until the key appears or the timeout passes.
// Thread safe (a mutex per object, flock between processes; a thread polling in get/wait does
// not hold the mutex between looks). Every wait, the lock included, is bounded by the timeout.
// The file is removed by the last FileStore (of `num_workers`, when given; else the last one
// alive) to be destroyed, as c10d's FileStore does. Keys it keeps for that bookkeeping are not
// counted by num_keys().

#include <map>
#include <mutex>
#include <string>

#include "tdist/core/store.h"

namespace tdist {

class FileStore : public Store {
 public:
  explicit FileStore(std::string path, int num_workers = -1, Millis timeout = kDefaultTimeout);
  ~FileStore() override;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  using Store::set;
  using Store::wait;

  const std::string& path() const { return path_; }

 private:
  class LockedFile;

  // Replays the records this object has not seen (Note [FileStore log] in file_store.cpp).
  void sync(LockedFile& file);
  // Appends one record (value is null for a delete) and applies it to cache_.
  void append(LockedFile& file, uint8_t op, const std::string& key, const Bytes* value);
  int64_t append_add(LockedFile& file, const std::string& key, int64_t delta);
  // Polls until every key exists; copies the first key's value into `first` when given.
  void wait_for(const std::vector<std::string>& keys, Millis timeout, Bytes* first = nullptr);

  // Constant after construction.
  const std::string path_;
  const int num_workers_;

  std::mutex mu_;
  std::map<std::string, Bytes> cache_;  // guarded by mu_: state as of offset_
  uint64_t offset_ = 0;                 // guarded by mu_: bytes of the log replayed into cache_
  uint64_t inode_ = 0;                  // guarded by mu_: the file offset_ refers to
};

}  // namespace tdist
