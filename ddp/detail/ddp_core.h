#pragma once
// The non-template part of DistributedDataParallel (tdist/ddp/distributed_data_parallel.h), and
// what its templates need to find the tensors of a forward's result. Not an API.

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tdist/ddp/comm_hooks.h"
#include "tdist/ddp/options.h"

namespace torch::nn {
class Module;
}
namespace tdist::comm {
class ProcessGroup;
}

namespace tdist::ddp {

class Reducer;
class Trace;

namespace detail {

// The non-template part of DistributedDataParallel.
class DDPCore {
 public:
  DDPCore(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<comm::ProcessGroup> pg,
          DDPOptions opts);
  ~DDPCore();

  // Returns whether this forward synchronizes (and prepares it: rebuild, buffers).
  bool pre_forward();
  // After forward: arms the reducer with forward's output tensors when `sync`.
  void post_forward(bool sync, const std::vector<at::Tensor>& outputs, bool outputs_known);

  void set_require_sync(bool on) { require_sync_ = on; }
  bool require_sync() const { return require_sync_; }
  Reducer& reducer() { return *reducer_; }
  const DDPOptions& options() const { return opts_; }
  const std::shared_ptr<comm::ProcessGroup>& process_group() const { return pg_; }
  const std::shared_ptr<Trace>& trace() const { return trace_; }

 private:
  std::chrono::milliseconds timeout() const;

  // Constant after construction:
  const std::shared_ptr<torch::nn::Module> module_;
  const std::shared_ptr<comm::ProcessGroup> pg_;
  const DDPOptions opts_;
  std::shared_ptr<Trace> trace_;
  std::unique_ptr<Reducer> reducer_;

  bool require_sync_ = true;
  int64_t forward_begin_us_ = 0;
};

// Collects the tensors of forward's result (for find_unused_parameters). run() returns false
// for types it cannot look into.
template <typename T, typename = void>
struct CollectTensors {
  static bool run(const T&, std::vector<at::Tensor>&) { return std::is_arithmetic_v<T>; }
};
template <>
struct CollectTensors<at::Tensor> {
  static bool run(const at::Tensor& t, std::vector<at::Tensor>& out) {
    out.push_back(t);
    return true;
  }
};
template <typename T, typename A>
struct CollectTensors<std::vector<T, A>> {
  static bool run(const std::vector<T, A>& v, std::vector<at::Tensor>& out) {
    bool ok = true;
    for (const auto& x : v) ok = CollectTensors<T>::run(x, out) && ok;
    return ok;
  }
};
template <typename... Ts>
struct CollectTensors<std::tuple<Ts...>> {
  static bool run(const std::tuple<Ts...>& t, std::vector<at::Tensor>& out) {
    return std::apply(
        [&](const auto&... xs) {
          return (CollectTensors<std::decay_t<decltype(xs)>>::run(xs, out) & ... & true);
        },
        t);
  }
};
template <typename A, typename B>
struct CollectTensors<std::pair<A, B>> {
  static bool run(const std::pair<A, B>& p, std::vector<at::Tensor>& out) {
    bool a = CollectTensors<A>::run(p.first, out);
    return CollectTensors<B>::run(p.second, out) && a;
  }
};
template <typename K, typename V, typename C, typename A>
struct CollectTensors<std::map<K, V, C, A>> {
  static bool run(const std::map<K, V, C, A>& m, std::vector<at::Tensor>& out) {
    bool ok = true;
    for (const auto& [k, v] : m) ok = CollectTensors<V>::run(v, out) && ok;
    return ok;
  }
};
template <typename K, typename V, typename H, typename E, typename A>
struct CollectTensors<std::unordered_map<K, V, H, E, A>> {
  static bool run(const std::unordered_map<K, V, H, E, A>& m, std::vector<at::Tensor>& out) {
    bool ok = true;
    for (const auto& [k, v] : m) ok = CollectTensors<V>::run(v, out) && ok;
    return ok;
  }
};

template <typename T>
struct IsSharedPtr : std::false_type {};
template <typename T>
struct IsSharedPtr<std::shared_ptr<T>> : std::true_type {};

}  // namespace detail

}  // namespace tdist::ddp
