// Dissemination barrier: in round k every rank signals rank r + 2^k and waits for rank r - 2^k;
// after ceil(log2 n) rounds every rank has (transitively) heard from every other one. The tokens
// are dropped unread (Exchange::skip): only their arrival counts.

#include "tdist/comm/algorithms/barrier_dissemination.h"

namespace tdist::comm::algorithms {

void barrier_dissemination(Context& c) {
  const int n = c.size;
  static const char kToken = 1;
  for (int dist = 1; dist < n; dist *= 2) {
    c.ex.send((c.rank + dist) % n, &kToken, 1);
    c.ex.skip((c.rank - dist + n) % n, 1);
    c.ex.run();
  }
}

}  // namespace tdist::comm::algorithms
