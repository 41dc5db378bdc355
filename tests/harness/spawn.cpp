#include "tests/harness/spawn.h"

#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "tdist/core/hash_store.h"

namespace tdist::test {

void spawn(int world_size, const RankFn& fn, Millis store_timeout) {
  auto store = std::make_shared<HashStore>(store_timeout);
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  threads.reserve(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        fn(rank, store);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace tdist::test
