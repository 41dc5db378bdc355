#pragma once
// The registry of callable functions and classes. A worker runs only what its program registered
// here by name: no code and no object graph travels on the wire (unlike torch.distributed.rpc,
// which unpickles whatever it receives).
//
//   int64_t add(int64_t a, int64_t b) { return a + b; }
//   rpc::register_function("add", &add);
//   rpc::register_function("scale", [](at::Tensor t, double s) { return t * s; });
//
//   rpc::register_class<Counter>("Counter")
//       .constructor<int64_t>()             // remote<Counter>(to, "Counter", 5)
//       .method("add", &Counter::add)       // rref.rpc_sync<int64_t>("add", 2)
//       .method("get", &Counter::get);
//
// Register before init_rpc (or at least before a peer calls). Argument and result types:
// arithmetic types, std::string, at::Tensor, RRef<T>, vectors/arrays/sets/maps/unordered_maps/
// tuples/pairs/optionals of these, and user types with a cereal serialize()/save()/load().
// Argument types must be default-constructible. A class's instances live on their owner behind
// RRefs; a class needs a cereal serialize() only if its values are fetched with to_here().
// Thread safety: registration and lookup may run concurrently from any thread. The registry is
// process-wide (one per program, shared by every agent of the process).

#include <cereal/details/traits.hpp>

#include <functional>
#include <memory>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "tdist/core/error.h"
#include "tdist/rpc/detail/archive.h"
#include "tdist/rpc/detail/callable.h"
#include "tdist/rpc/signature.h"

namespace tdist::rpc {
class Registry {
 public:
  // InvalidArgument when `name` is empty or already registered (functions and constructors share
  // one namespace).
  void add_function(detail::FunctionEntry entry);
  // The function or constructor called `name`, or nullptr.
  std::shared_ptr<const detail::FunctionEntry> find_function(const std::string& name) const;

  void add_class(const std::string& name, const detail::TypeInfo& type);
  void add_method(const detail::TypeInfo& type, detail::MethodEntry entry);
  // The method `name` of the class whose values have type hash `type_hash`, or nullptr.
  std::shared_ptr<const detail::MethodEntry> find_method(uint64_t type_hash,
                                                         const std::string& name) const;
  bool has_class(uint64_t type_hash) const;

 private:
  struct ClassEntry {
    std::string name;
    std::unordered_map<std::string, std::shared_ptr<const detail::MethodEntry>> methods;
  };

  mutable std::shared_mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<const detail::FunctionEntry>> functions_;
  std::unordered_map<uint64_t, ClassEntry> classes_;  // by TypeInfo::hash
};

// The process-wide registry.
Registry& registry();

template <class F>
void register_function(const std::string& name, F f) {
  using Traits = detail::FnTraits<std::decay_t<F>>;
  using Inv = detail::Invoker<typename Traits::result, typename Traits::args>;
  detail::FunctionEntry e;
  e.name = name;
  e.signature = Inv::signature();
  e.invoke = [f = std::move(f), what = "arguments of '" + name + "'"](
                 detail::ArgInputArchive& ar) mutable { return Inv::call(f, ar, what); };
  registry().add_function(std::move(e));
}

// Registers a class; chain constructor<Args...>() and method(name, fn).
template <class T>
class ClassBuilder {
 public:
  explicit ClassBuilder(std::string name) : name_(std::move(name)) {
    registry().add_class(name_, detail::type_info_of<T>());
  }

  // remote<T>(to, "<class name>", args...) constructs a T on the owner. One constructor per
  // class name.
  template <class... A>
  ClassBuilder& constructor() {
    detail::FunctionEntry e;
    e.name = name_;
    e.signature = signature_of<T, A...>();
    e.invoke = [what = "constructor arguments of '" + name_ + "'"](detail::ArgInputArchive& ar) {
      auto make = [](A... a) { return std::make_shared<T>(std::move(a)...); };
      detail::AnyValue v =
          detail::Invoker<std::shared_ptr<T>, std::tuple<A...>>::call(make, ar, what);
      // Unwrap: the value is the T itself, not a shared_ptr to it.
      return detail::AnyValue{*std::static_pointer_cast<std::shared_ptr<T>>(v.ptr),
                              &detail::type_info_of<T>()};
    };
    registry().add_function(std::move(e));
    return *this;
  }

  // `m` is a member function pointer of T, or a callable whose first parameter is T&.
  template <class M>
  ClassBuilder& method(const std::string& name, M m) {
    using Traits = detail::FnTraits<std::decay_t<M>>;
    detail::MethodEntry e;
    e.name = name;
    if constexpr (std::is_member_function_pointer_v<M>) {
      using Inv = detail::Invoker<typename Traits::result, typename Traits::args>;
      e.signature = Inv::signature();
      e.invoke = [m, what = "arguments of method '" + name_ + "." + name + "'"](
                     void* self, detail::ArgInputArchive& ar) {
        M fn = m;
        return Inv::call(fn, ar, what, static_cast<T*>(self));
      };
    } else {
      using Inv = detail::Invoker<typename Traits::result,
                                  typename detail::DropFirst<typename Traits::args>::type>;
      e.signature = Inv::signature();
      e.invoke = [m, what = "arguments of method '" + name_ + "." + name + "'"](
                     void* self, detail::ArgInputArchive& ar) mutable {
        return Inv::call(m, ar, what, *static_cast<T*>(self));
      };
    }
    registry().add_method(detail::type_info_of<T>(), std::move(e));
    return *this;
  }

 private:
  std::string name_;
};

template <class T>
ClassBuilder<T> register_class(const std::string& name) {
  return ClassBuilder<T>(name);
}

}  // namespace tdist::rpc
