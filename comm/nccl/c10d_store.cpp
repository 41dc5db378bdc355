#include "tdist/comm/nccl/c10d_store.h"

namespace tdist::comm::nccl {

C10dStore::C10dStore(std::shared_ptr<tdist::Store> store, std::chrono::milliseconds timeout)
    : ::c10d::Store(timeout), store_(std::move(store)) {}

c10::intrusive_ptr<::c10d::Store> C10dStore::clone() {
  return c10::make_intrusive<C10dStore>(store_, getTimeout());
}

void C10dStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  store_->set(key, value);
}

std::vector<uint8_t> C10dStore::compareSet(const std::string& key,
                                           const std::vector<uint8_t>& expected,
                                           const std::vector<uint8_t>& desired) {
  return store_->compare_set(key, expected, desired);
}

std::vector<uint8_t> C10dStore::get(const std::string& key) {
  store_->wait({key}, getTimeout());
  return store_->get(key);
}

int64_t C10dStore::add(const std::string& key, int64_t value) { return store_->add(key, value); }

bool C10dStore::deleteKey(const std::string& key) { return store_->delete_key(key); }

bool C10dStore::check(const std::vector<std::string>& keys) { return store_->check(keys); }

int64_t C10dStore::getNumKeys() { return store_->num_keys(); }

void C10dStore::wait(const std::vector<std::string>& keys) { store_->wait(keys, getTimeout()); }

void C10dStore::wait(const std::vector<std::string>& keys,
                     const std::chrono::milliseconds& timeout) {
  store_->wait(keys, timeout);
}

}  // namespace tdist::comm::nccl
