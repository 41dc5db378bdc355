#pragma once
// The body every multi-process store test runs in each child: `adds` increments of "counter",
// its own "rank/<r>" key, a compare_set race for "leader" (recorded as "leader_seen/<r>"), then
// a wait for every rank's key and a check of their values. Returns the child's exit code
// (0 ok, 2 a rank key held the wrong value).
#include <string>
#include <vector>

#include "tdist/core/store.h"

namespace tdist::test {

inline int exercise_store(Store& store, int rank, int world_size, int adds) {
  for (int i = 0; i < adds; ++i) store.add("counter", 1);
  store.set("rank/" + std::to_string(rank), std::to_string(rank * 10));
  // The first compare_set wins; every rank must see the same leader.
  Bytes leader = store.compare_set("leader", {}, to_bytes(std::to_string(rank)));
  store.set("leader_seen/" + std::to_string(rank), leader);
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r) keys.push_back("rank/" + std::to_string(r));
  store.wait(keys);
  for (int r = 0; r < world_size; ++r) {
    if (store.get_string("rank/" + std::to_string(r)) != std::to_string(r * 10)) return 2;
  }
  return 0;
}

}  // namespace tdist::test
