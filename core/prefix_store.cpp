#include "tdist/core/prefix_store.h"

#include "tdist/core/error.h"

namespace tdist {

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> store)
    : Store(store ? store->timeout() : kDefaultTimeout),
      prefix_(std::move(prefix)),
      store_(std::move(store)) {
  TDIST_CHECK_ARG(store_ != nullptr, "PrefixStore needs an underlying store");
}

void PrefixStore::set(const std::string& k, const Bytes& value) { store_->set(key(k), value); }

Bytes PrefixStore::get(const std::string& k) {
  // Wait with this store's own timeout (set_timeout on a PrefixStore must govern its get), then
  // read: the key cannot disappear in between unless someone deletes it, which get() reports.
  store_->wait({key(k)}, timeout());
  return store_->get(key(k));
}

int64_t PrefixStore::add(const std::string& k, int64_t delta) { return store_->add(key(k), delta); }

Bytes PrefixStore::compare_set(const std::string& k, const Bytes& expected, const Bytes& desired) {
  return store_->compare_set(key(k), expected, desired);
}

void PrefixStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const auto& k : keys) full.push_back(key(k));
  store_->wait(full, timeout);
}

bool PrefixStore::check(const std::vector<std::string>& keys) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const auto& k : keys) full.push_back(key(k));
  return store_->check(full);
}

bool PrefixStore::delete_key(const std::string& k) { return store_->delete_key(key(k)); }

int64_t PrefixStore::num_keys() { return store_->num_keys(); }

}  // namespace tdist
