#include "tdist/rpc/registry.h"

#include "tdist/core/hash.h"

#include <cxxabi.h>

#include <cstdlib>
#include <mutex>

#include "tdist/core/tensor_wire.h"
#include "tdist/rpc/types.h"

namespace tdist::rpc {

std::string GloballyUniqueId::str() const {
  return ::tdist::str("(", created_on, ",", local_id, ")");
}

namespace detail {

std::string demangle(const char* mangled) {
  int status = 0;
  char* out = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  if (status != 0 || out == nullptr) return mangled;
  std::string s(out);
  std::free(out);
  return s;
}

uint64_t fnv1a(const std::string& s) { return fnv1a64(s); }

void check_all_read(ArgInputArchive& ar, const std::string& what) {
  if (ar.remaining() != 0) {
    throw ProtocolError(str(what, ": ", ar.remaining(), " bytes left over after decoding"));
  }
}

void save_tensor(ArgOutputArchive& ar, const at::Tensor& t) {
  uint32_t index = kUndefinedTensor;
  if (t.defined()) {
    describe_tensor(t);  // InvalidArgument for a non-CPU tensor or an unsupported dtype
    auto& tensors = *ar.context().tensors;
    TDIST_CHECK_ARG(tensors.size() < kUndefinedTensor, "too many tensors in one message");
    index = static_cast<uint32_t>(tensors.size());
    tensors.push_back(t);
  }
  ar(index);
}

void load_tensor(ArgInputArchive& ar, at::Tensor& t) {
  uint32_t index = 0;
  ar(index);
  if (index == kUndefinedTensor) {
    t = at::Tensor();
    return;
  }
  const auto& tensors = *ar.context().tensors;
  if (index >= tensors.size()) {
    throw ProtocolError(
        str("tensor index ", index, " but the message carries ", tensors.size(), " tensors"));
  }
  t = tensors[index];
}

}  // namespace detail

void Registry::add_function(detail::FunctionEntry entry) {
  TDIST_CHECK_ARG(!entry.name.empty(), "an RPC function needs a name");
  std::unique_lock<std::shared_mutex> lock(mu_);
  auto name = entry.name;
  auto [it, inserted] =
      functions_.emplace(name, std::make_shared<const detail::FunctionEntry>(std::move(entry)));
  TDIST_CHECK_ARG(inserted, "RPC function or constructor '", name, "' is already registered");
}

std::shared_ptr<const detail::FunctionEntry> Registry::find_function(
    const std::string& name) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  auto it = functions_.find(name);
  return it == functions_.end() ? nullptr : it->second;
}

void Registry::add_class(const std::string& name, const detail::TypeInfo& type) {
  TDIST_CHECK_ARG(!name.empty(), "an RPC class needs a name");
  std::unique_lock<std::shared_mutex> lock(mu_);
  auto [it, inserted] = classes_.emplace(type.hash, ClassEntry{name, {}});
  TDIST_CHECK_ARG(inserted, "RPC class ", type.name, " is already registered as '", it->second.name,
                  "'");
}

void Registry::add_method(const detail::TypeInfo& type, detail::MethodEntry entry) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  auto it = classes_.find(type.hash);
  TDIST_CHECK_ARG(it != classes_.end(), "class ", type.name, " is not registered");
  auto name = entry.name;
  auto [mit, inserted] = it->second.methods.emplace(
      name, std::make_shared<const detail::MethodEntry>(std::move(entry)));
  TDIST_CHECK_ARG(inserted, "method '", it->second.name, ".", name, "' is already registered");
}

std::shared_ptr<const detail::MethodEntry> Registry::find_method(uint64_t type_hash,
                                                                 const std::string& name) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  auto it = classes_.find(type_hash);
  if (it == classes_.end()) return nullptr;
  auto mit = it->second.methods.find(name);
  return mit == it->second.methods.end() ? nullptr : mit->second;
}

bool Registry::has_class(uint64_t type_hash) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return classes_.count(type_hash) > 0;
}

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace tdist::rpc
