// Uses tdist as an installed package: a store, the wire format and a libtorch tensor.
#include <ATen/ATen.h>

#include <iostream>

#include "tdist/core/hash_store.h"
#include "tdist/core/serialize.h"

int main() {
  tdist::HashStore store;
  store.set("greeting", "hello from an embedding service");
  const int64_t counter = store.add("counter", 41) + store.add("counter", 1) - 41;
  at::Tensor t = at::arange(6, at::kFloat).reshape({2, 3});
  at::Tensor back = tdist::decode<at::Tensor>(tdist::encode(t));
  std::cout << store.get_string("greeting") << "; counter=" << counter << "; tensor round trip "
            << (back.equal(t) ? "ok" : "MISMATCH") << "\n";
  return back.equal(t) && counter == 42 ? 0 : 1;
}
