#include "tdist/python/tdist_c10d/store_adapter.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdint>
#include <limits>

#include "tdist/core/error.h"

namespace tdist::c10d_backend {
namespace {

std::string join(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) {
    if (!out.empty()) out += ", ";
    out += "'" + k + "'";
  }
  return out;
}

// Runs fn, turning c10d's store errors into tdist's. c10d reports a wait that ran out of time as
// DistStoreError (TCPStore, FileStore, HashStore) and a broken connection as DistNetworkError.
template <typename Fn>
auto translate(const char* what, const std::string& keys, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const c10::DistNetworkError& e) {
    TDIST_THROW(NetworkError, "c10d store ", what, "(", keys,
                ") failed: ", e.what_without_backtrace());
  } catch (const c10::DistStoreError& e) {
    TDIST_THROW(TimeoutError, "c10d store ", what, "(", keys,
                ") failed: ", e.what_without_backtrace());
  } catch (const c10::Error& e) {
    TDIST_THROW(Error, "c10d store ", what, "(", keys, ") failed: ", e.what_without_backtrace());
  }
}

constexpr Millis kLongestWait{std::numeric_limits<int32_t>::max()};

}  // namespace

StoreAdapter::StoreAdapter(c10::intrusive_ptr<::c10d::Store> store, Millis timeout)
    : tdist::Store(timeout), store_(std::move(store)) {
  TDIST_CHECK_ARG(store_, "StoreAdapter needs a c10d store");
}

StoreAdapter::~StoreAdapter() = default;

void StoreAdapter::set(const std::string& key, const Bytes& value) {
  translate("set", key, [&] { store_->set(key, value); });
}

Bytes StoreAdapter::get(const std::string& key) {
  // c10d's get waits with the c10d store's timeout; wait first so that ours applies.
  wait({key}, timeout());
  return translate("get", key, [&] { return store_->get(key); });
}

int64_t StoreAdapter::add(const std::string& key, int64_t delta) {
  return translate("add", key, [&] { return store_->add(key, delta); });
}

Bytes StoreAdapter::compare_set(const std::string& key, const Bytes& expected,
                                const Bytes& desired) {
  return translate("compare_set", key, [&] { return store_->compareSet(key, expected, desired); });
}

void StoreAdapter::wait(const std::vector<std::string>& keys, Millis timeout) {
  // tdist spells "no timeout" as zero; c10d's stores take zero literally (they time out at once),
  // and pass the value on to poll() as an int: wait for the longest span poll() can express.
  const Millis c10d_timeout =
      (timeout == kNoTimeout || timeout > kLongestWait) ? kLongestWait : timeout;
  translate("wait", join(keys), [&] { store_->wait(keys, c10d_timeout); });
}

bool StoreAdapter::check(const std::vector<std::string>& keys) {
  return translate("check", join(keys), [&] { return store_->check(keys); });
}

bool StoreAdapter::delete_key(const std::string& key) {
  return translate("delete_key", key, [&] { return store_->deleteKey(key); });
}

int64_t StoreAdapter::num_keys() {
  return translate("num_keys", "", [&] { return store_->getNumKeys(); });
}

std::string StoreAdapter::server_host() const {
  c10::intrusive_ptr<::c10d::Store> store = store_;
  while (auto* prefix = dynamic_cast<::c10d::PrefixStore*>(store.get())) {
    store = prefix->getUnderlyingStore();
  }
  if (auto* tcp = dynamic_cast<::c10d::TCPStore*>(store.get())) return tcp->getHost();
  return {};
}

}  // namespace tdist::c10d_backend
