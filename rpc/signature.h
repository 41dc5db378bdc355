#pragma once
// Type names and call signatures. A caller's rpc_async<R>(to, "f", args...) and the callee's
// registered "f" must agree on the types; both sides compute the signature text, e.g.
// "int64(int64,float32)", and the call carries its 64-bit hash so that the callee refuses a
// mismatch with an error instead of decoding garbage.
//
// Names are stable across builds for the built-in kinds (arithmetic types by size and
// signedness, std::string, Tensor, containers of these, RRef<T>); a user type is named by its
// demangled C++ name, or by specializing tdist::rpc::TypeName<T> with a static name().

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tdist/rpc/detail/type_names.h"

namespace tdist::rpc {

template <class T, class Enable = void>
struct TypeName {
  static std::string name() { return detail::demangle(typeid(T).name()); }
};

template <class T>
std::string type_name() {
  return TypeName<std::remove_cv_t<std::remove_reference_t<T>>>::name();
}

template <>
struct TypeName<void> {
  static std::string name() { return "void"; }
};
template <>
struct TypeName<bool> {
  static std::string name() { return "bool"; }
};
template <class T>
struct TypeName<T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>>> {
  static std::string name() {
    return std::string(std::is_signed_v<T> ? "int" : "uint") + std::to_string(sizeof(T) * 8);
  }
};
template <class T>
struct TypeName<T, std::enable_if_t<std::is_floating_point_v<T>>> {
  static std::string name() { return "float" + std::to_string(sizeof(T) * 8); }
};
template <>
struct TypeName<std::string> {
  static std::string name() { return "string"; }
};
template <>
struct TypeName<at::Tensor> {
  static std::string name() { return "Tensor"; }
};
template <class T, class A>
struct TypeName<std::vector<T, A>> {
  static std::string name() { return "vector<" + type_name<T>() + ">"; }
};
template <class T, size_t N>
struct TypeName<std::array<T, N>> {
  static std::string name() { return "array<" + type_name<T>() + "," + std::to_string(N) + ">"; }
};
template <class T, class C, class A>
struct TypeName<std::set<T, C, A>> {
  static std::string name() { return "set<" + type_name<T>() + ">"; }
};
template <class K, class V, class C, class A>
struct TypeName<std::map<K, V, C, A>> {
  static std::string name() { return "map<" + type_name<K>() + "," + type_name<V>() + ">"; }
};
template <class K, class V, class H, class E, class A>
struct TypeName<std::unordered_map<K, V, H, E, A>> {
  static std::string name() {
    return "unordered_map<" + type_name<K>() + "," + type_name<V>() + ">";
  }
};
template <class T>
struct TypeName<std::optional<T>> {
  static std::string name() { return "optional<" + type_name<T>() + ">"; }
};
template <class A, class B>
struct TypeName<std::pair<A, B>> {
  static std::string name() { return "pair<" + type_name<A>() + "," + type_name<B>() + ">"; }
};
template <class... T>
struct TypeName<std::tuple<T...>> {
  static std::string name() {
    std::string s = "tuple<";
    bool first = true;
    ((s += (first ? "" : ","), s += type_name<T>(), first = false), ...);
    return s + ">";
  }
};

// Arguments as they travel: string literals and char pointers become std::string.
template <class T>
struct WireType {
  using type = std::decay_t<T>;
};
template <>
struct WireType<const char*> {
  using type = std::string;
};
template <>
struct WireType<char*> {
  using type = std::string;
};
template <class T>
using wire_t = typename WireType<std::decay_t<T>>::type;

template <class T>
decltype(auto) wire_arg(T&& v) {
  if constexpr (std::is_same_v<std::decay_t<T>, const char*> ||
                std::is_same_v<std::decay_t<T>, char*>) {
    return std::string(v);
  } else {
    return std::forward<T>(v);
  }
}

struct Signature {
  std::string text;
  uint64_t hash = 0;
};

// "R(A1,A2,...)" over wire types; computed once per instantiation.
template <class R, class... Args>
const Signature& signature_of() {
  static const Signature sig = [] {
    Signature s;
    s.text = type_name<R>() + "(";
    bool first = true;
    ((s.text += (first ? "" : ","), s.text += type_name<wire_t<Args>>(), first = false), ...);
    s.text += ")";
    s.hash = detail::fnv1a(s.text);
    return s;
  }();
  return sig;
}

}  // namespace tdist::rpc
