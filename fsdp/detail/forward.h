#pragma once
// What fully_shard's templates (fsdp/fully_shard.h) need to wrap a unit's forward: finding the
// tensors of its arguments and results, and running it between the state's pre_forward and
// post_forward (Note [Sharded data parallel] 1 in fsdp/fully_shard.h). Not an API.

#include <ATen/core/Tensor.h>

#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tdist/fsdp/detail/fsdp_state.h"

namespace tdist::fsdp {
namespace detail {

// Visits every at::Tensor of a forward's argument or result in a fixed order; returns false for
// types it cannot look into (which then hold tensors FSDP does not see).
template <typename T, typename = void>
struct VisitTensors {
  template <typename F>
  static bool run(T&, F&&) {
    return std::is_arithmetic_v<T> || std::is_enum_v<T>;
  }
};
template <>
struct VisitTensors<at::Tensor> {
  template <typename F>
  static bool run(at::Tensor& t, F&& f) {
    f(t);
    return true;
  }
};
template <typename T, typename A>
struct VisitTensors<std::vector<T, A>> {
  template <typename F>
  static bool run(std::vector<T, A>& v, F&& f) {
    bool ok = true;
    for (auto& x : v) ok = VisitTensors<T>::run(x, f) && ok;
    return ok;
  }
};
template <typename... Ts>
struct VisitTensors<std::tuple<Ts...>> {
  template <typename F>
  static bool run(std::tuple<Ts...>& t, F&& f) {
    return std::apply(
        [&](auto&... xs) {
          return (VisitTensors<std::decay_t<decltype(xs)>>::run(xs, f) & ... & true);
        },
        t);
  }
};
template <typename A, typename B>
struct VisitTensors<std::pair<A, B>> {
  template <typename F>
  static bool run(std::pair<A, B>& p, F&& f) {
    const bool a = VisitTensors<A>::run(p.first, f);
    return VisitTensors<B>::run(p.second, f) && a;
  }
};

template <typename A>
void collect_input(std::vector<at::Tensor>& out, const A& arg) {
  if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor>) out.push_back(arg);
}

// The argument forward receives: the alias pre_forward made of a tensor argument, else itself.
template <typename A>
decltype(auto) pass_input(const std::vector<at::Tensor>& originals,
                          const std::vector<at::Tensor>& aliases, A&& arg) {
  if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor>) {
    for (size_t i = 0; i < originals.size(); ++i) {
      if (originals[i].is_same(arg)) return at::Tensor(aliases[i]);
    }
    return at::Tensor(arg);
  } else {
    return std::forward<A>(arg);
  }
}

// Runs fn(args...) as the forward of group g of `state` (Note [Sharded data parallel] 1).
template <typename Fn, typename... Args>
auto run_unit(FSDPState& state, int g, Fn&& fn, Args&&... args) {
  std::vector<at::Tensor> originals;
  (collect_input(originals, args), ...);
  std::vector<at::Tensor> aliases = originals;
  state.pre_forward(g, aliases);
  auto out = fn(pass_input(originals, aliases, std::forward<Args>(args))...);
  std::vector<at::Tensor> outputs;
  const bool known =
      VisitTensors<decltype(out)>::run(out, [&](at::Tensor& t) { outputs.push_back(t); });
  state.post_forward(g, outputs, known);
  size_t k = 0;
  VisitTensors<decltype(out)>::run(out, [&](at::Tensor& t) { t = outputs[k++]; });
  return out;
}

template <typename T>
struct IsSharedPtr : std::false_type {};
template <typename T>
struct IsSharedPtr<std::shared_ptr<T>> : std::true_type {};

template <typename M>
std::shared_ptr<torch::nn::Module> module_ptr(const M& m) {
  if constexpr (IsSharedPtr<M>::value) {
    return m;
  } else {
    return m.ptr();
  }
}

}  // namespace detail

}  // namespace tdist::fsdp
