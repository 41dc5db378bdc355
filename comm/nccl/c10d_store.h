#pragma once
// C10dStore: a tdist::Store seen as the c10d::Store that PyTorch's ProcessGroupNCCL exchanges its
// NCCL unique ids through. Every call maps to the tdist call of the same meaning; c10d's
// wait(keys) uses the timeout given at construction (setTimeout changes it), and get() blocks
// until the key exists, as c10d's stores do.
//
// Thread safety: as the wrapped store's (every method may be called from any thread).

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>

#include "tdist/core/store.h"

namespace tdist::comm::nccl {

class C10dStore : public ::c10d::Store {
 public:
  C10dStore(std::shared_ptr<tdist::Store> store, std::chrono::milliseconds timeout);

  c10::intrusive_ptr<::c10d::Store> clone() override;
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  const std::shared_ptr<tdist::Store> store_;
};

}  // namespace tdist::comm::nccl
