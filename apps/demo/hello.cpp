// tdist-hello: the smallest multi-process tdist job. The ranks rendezvous through the store named
// by env:// (rank 0 hosts it), build a process group, allreduce a tensor holding rank + 1, and
// each prints the sum.
//
//   tdist-run --nproc-per-node 2 tdist-hello
#include <ATen/ATen.h>

#include <iostream>

#include "tdist/comm/process_group.h"
#include "tdist/core/logging.h"

int main() {
  try {
    tdist::comm::ProcessGroup::Options opts;
    opts.timeout = std::chrono::seconds(60);
    auto pg = tdist::comm::create_process_group("env://", -1, -1, opts);
    tdist::set_log_rank(pg->rank());
    at::Tensor t = at::full({4}, static_cast<float>(pg->rank() + 1));
    pg->allreduce(t)->wait();
    // Rank 0 hosts the store; nobody leaves before everyone is done with the group.
    pg->barrier()->wait();
    const int n = pg->size();
    std::cout << "rank " << pg->rank() << " of " << n
              << ": sum of every rank's tensor = " << t[0].item<float>() << " (expected "
              << n * (n + 1) / 2 << ")" << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "tdist-hello: " << e.what() << std::endl;
    return 1;
  }
}
