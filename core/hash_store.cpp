#include "tdist/core/hash_store.h"

#include "tdist/core/detail/store_util.h"

namespace tdist {

void HashStore::set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    data_[key] = value;
  }
  cv_.notify_all();
}

Bytes HashStore::get(const std::string& key) {
  std::unique_lock<std::mutex> lock(mu_);
  wait_locked(lock, {key}, timeout());
  return data_.at(key);
}

int64_t HashStore::add(const std::string& key, int64_t delta) {
  int64_t value = delta;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = data_.find(key);
    if (it != data_.end()) value += detail::parse_counter(key, it->second);
    data_[key] = to_bytes(std::to_string(value));
  }
  cv_.notify_all();
  return value;
}

Bytes HashStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = data_.find(key);
  if (it == data_.end()) {
    if (!expected.empty()) return expected;
    data_[key] = desired;
  } else if (it->second == expected) {
    it->second = desired;
  } else {
    return it->second;
  }
  lock.unlock();
  cv_.notify_all();
  return desired;
}

void HashStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  wait_locked(lock, keys, timeout);
}

void HashStore::wait_locked(std::unique_lock<std::mutex>& lock,
                            const std::vector<std::string>& keys, Millis timeout) {
  auto all_present = [&] {
    for (const auto& k : keys)
      if (!data_.count(k)) return false;
    return true;
  };
  const auto deadline = detail::deadline_after(timeout);
  while (!all_present()) {
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && !all_present()) {
      std::vector<std::string> missing;
      for (const auto& k : keys)
        if (!data_.count(k)) missing.push_back(k);
      detail::throw_wait_timeout("HashStore", missing, timeout);
    }
  }
}

bool HashStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& k : keys)
    if (!data_.count(k)) return false;
  return true;
}

bool HashStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  return data_.erase(key) > 0;
}

int64_t HashStore::num_keys() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(data_.size());
}

}  // namespace tdist
