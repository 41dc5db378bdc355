// tdist-hello: the smallest multi-process tdist job. Each rank finds the others through the
// store named by env:// (rank 0 hosts it), publishes a tensor, and prints the sum over all
// ranks' tensors, read back through the store.
//
//   tdist-run --nproc-per-node 2 tdist-hello
#include <ATen/ATen.h>

#include <iostream>
#include <string>
#include <vector>

#include "tdist/core/logging.h"
#include "tdist/core/rendezvous.h"
#include "tdist/core/serialize.h"

int main() {
  try {
    auto rdzv = tdist::rendezvous("env://", -1, -1, std::chrono::seconds(60));
    tdist::set_log_rank(rdzv.rank);
    at::Tensor mine = at::full({4}, static_cast<float>(rdzv.rank + 1));
    rdzv.store->set("hello/" + std::to_string(rdzv.rank), tdist::encode(mine));
    at::Tensor sum = at::zeros({4});
    for (int r = 0; r < rdzv.world_size; ++r) {
      sum += tdist::decode<at::Tensor>(rdzv.store->get("hello/" + std::to_string(r)));
    }
    // Rank 0 hosts the store: it leaves only after everyone has read what they need.
    rdzv.store->set("hello/done/" + std::to_string(rdzv.rank), "1");
    if (rdzv.rank == 0) {
      std::vector<std::string> done;
      for (int r = 0; r < rdzv.world_size; ++r) done.push_back("hello/done/" + std::to_string(r));
      rdzv.store->wait(done);
    }
    std::cout << "rank " << rdzv.rank << " of " << rdzv.world_size
              << ": sum of every rank's tensor = " << sum[0].item<float>()
              << " (expected " << rdzv.world_size * (rdzv.world_size + 1) / 2 << ")"
              << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "tdist-hello: " << e.what() << std::endl;
    return 1;
  }
}
