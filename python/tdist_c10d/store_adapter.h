#pragma once
// StoreAdapter: presents the c10d::Store that torch.distributed hands a backend (a PrefixStore over
// the TCPStore/FileStore of init_process_group) as a tdist::Store, so that
// tdist::comm::create_process_group can rendezvous through it.
//
// Operations map one to one (set, get, add, compareSet, wait, check, deleteKey, getNumKeys).
// Timeouts: blocking calls use this adapter's timeout (tdist's Store::timeout(), set from the
// backend's timeout), not the c10d store's own: get waits for its key first with that timeout.
// Errors: a c10d store timeout becomes tdist::TimeoutError, another store or network failure
// tdist::NetworkError; both name the key(s) and keep c10d's message.
//
// Thread safety: as the underlying c10d store (c10d's TCPStore, FileStore, HashStore and
// PrefixStore serialise their calls). Never touches Python: a store implemented in Python takes
// the GIL itself (c10d's PyStore trampoline), so callers must not hold it while they block.
// Ownership: holds a reference on the c10d store.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>
#include <vector>

#include "tdist/core/store.h"

namespace tdist::c10d_backend {

class StoreAdapter : public tdist::Store {
 public:
  StoreAdapter(c10::intrusive_ptr<::c10d::Store> store, Millis timeout);
  ~StoreAdapter() override;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  // The host of the c10d TCPStore under any c10d PrefixStores (init_method tcp:// or env://);
  // empty for other c10d stores.
  std::string server_host() const override;
  using tdist::Store::set;
  using tdist::Store::wait;

  const c10::intrusive_ptr<::c10d::Store>& underlying() const { return store_; }

 private:
  // Constant after construction.
  const c10::intrusive_ptr<::c10d::Store> store_;
};

}  // namespace tdist::c10d_backend
