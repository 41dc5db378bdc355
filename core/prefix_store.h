#pragma once
// PrefixStore: scopes every key of an underlying store under "<prefix>/". Used to give each
// process group (and each subgroup) its own key space over one shared store. Thread safety and
// blocking behaviour are those of the underlying store; num_keys() counts the whole store
// (as c10d's PrefixStore does).

#include <memory>

#include "tdist/core/store.h"

namespace tdist {

class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> store);

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  std::string server_host() const override { return store_->server_host(); }
  using Store::set;
  using Store::wait;

  const std::shared_ptr<Store>& underlying() const { return store_; }

 private:
  std::string key(const std::string& k) const { return prefix_ + "/" + k; }

  // Constant after construction.
  const std::string prefix_;
  const std::shared_ptr<Store> store_;
};

}  // namespace tdist
