#pragma once
// What the registry (rpc/registry.h) keeps and how it calls it: a type's runtime description
// (TypeInfo: name, hash, encoder), type-erased values (AnyValue), the entries of registered
// functions and methods, and the templates that decode a call's arguments and invoke the
// callable with them. Plain data and pure templates: no state, no synchronization.

#include <cereal/details/traits.hpp>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "tdist/rpc/detail/archive.h"
#include "tdist/rpc/signature.h"

namespace tdist::rpc::detail {

// A type as values of it are held and sent.
struct TypeInfo {
  std::string name;
  uint64_t hash = 0;
  // Writes a value of this type; nullptr when the type has no cereal serialization.
  void (*encode)(const void* value, ArgOutputArchive& ar) = nullptr;
};

template <class T>
const TypeInfo& type_info_of() {
  static const TypeInfo info = [] {
    TypeInfo i;
    i.name = type_name<T>();
    i.hash = fnv1a(i.name);
    if constexpr (!std::is_void_v<T>) {
      if constexpr (cereal::traits::is_output_serializable<T, ArgOutputArchive>::value) {
        i.encode = [](const void* p, ArgOutputArchive& ar) { ar(*static_cast<const T*>(p)); };
      }
    }
    return i;
  }();
  return info;
}

// A type-erased value: a result about to be sent, or an RRef's value on its owner.
struct AnyValue {
  std::shared_ptr<void> ptr;  // null for void
  const TypeInfo* type = nullptr;
};

struct FunctionEntry {
  std::string name;
  Signature signature;
  std::function<AnyValue(ArgInputArchive&)> invoke;
};

struct MethodEntry {
  std::string name;
  Signature signature;
  std::function<AnyValue(void* self, ArgInputArchive&)> invoke;
};

// Callable introspection: result type and argument types of functions, lambdas, functors and
// member function pointers.
template <class F>
struct FnTraits : FnTraits<decltype(&std::decay_t<F>::operator())> {};
template <class R, class... A>
struct FnTraits<R (*)(A...)> {
  using result = R;
  using args = std::tuple<A...>;
};
template <class R, class... A>
struct FnTraits<R(A...)> : FnTraits<R (*)(A...)> {};
template <class C, class R, class... A>
struct FnTraits<R (C::*)(A...)> : FnTraits<R (*)(A...)> {
  using klass = C;
};
template <class C, class R, class... A>
struct FnTraits<R (C::*)(A...) const> : FnTraits<R (*)(A...)> {
  using klass = C;
};

void check_all_read(ArgInputArchive& ar, const std::string& what);

// Decodes the arguments, checks that nothing is left, calls `f(prefix..., args...)`.
template <class R, class... A, class F, class... Prefix, size_t... I>
AnyValue invoke_decoded(F& f, ArgInputArchive& ar, const std::string& what,
                        std::index_sequence<I...>, Prefix&&... prefix) {
  std::tuple<std::decay_t<A>...> args;
  if constexpr (sizeof...(A) > 0) ar(std::get<I>(args)...);
  check_all_read(ar, what);
  if constexpr (std::is_void_v<R>) {
    std::invoke(f, std::forward<Prefix>(prefix)..., std::forward<A>(std::get<I>(args))...);
    return AnyValue{nullptr, &type_info_of<void>()};
  } else {
    return AnyValue{std::make_shared<std::decay_t<R>>(std::invoke(
                        f, std::forward<Prefix>(prefix)..., std::forward<A>(std::get<I>(args))...)),
                    &type_info_of<std::decay_t<R>>()};
  }
}

template <class R, class ArgsTuple>
struct Invoker;
template <class R, class... A>
struct Invoker<R, std::tuple<A...>> {
  template <class F, class... Prefix>
  static AnyValue call(F& f, ArgInputArchive& ar, const std::string& what, Prefix&&... prefix) {
    return invoke_decoded<R, A...>(f, ar, what, std::index_sequence_for<A...>{},
                                   std::forward<Prefix>(prefix)...);
  }
  static const Signature& signature() { return signature_of<std::decay_t<R>, A...>(); }
};

template <class Tuple>
struct DropFirst;
template <class First, class... Rest>
struct DropFirst<std::tuple<First, Rest...>> {
  using type = std::tuple<Rest...>;
};

}  // namespace tdist::rpc::detail
