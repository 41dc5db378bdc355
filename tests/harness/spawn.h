#pragma once
// Thread harness (Gloo's BaseTest::spawn): runs fn(rank, store) on `world_size` threads that share
// one HashStore, joins them all, and rethrows the first error any rank raised (the others still
// run to completion or to their own error, so a test must not leave a rank blocked forever:
// use timeouts in what the ranks call).

#include <functional>
#include <memory>

#include "tdist/core/store.h"

namespace tdist::test {

using RankFn = std::function<void(int rank, std::shared_ptr<Store> store)>;

void spawn(int world_size, const RankFn& fn, Millis store_timeout = Millis(30000));

}  // namespace tdist::test
