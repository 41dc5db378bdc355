#pragma once
// Rendezvous: turns an init_method URL into a store, a rank and a world size (c10d's
// `rendezvous`). Accepted forms:
//   env://                         MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (or SLURM / Open
//                                  MPI variables; see env.h). Rank 0 hosts the TCPStore server.
//   tcp://host:port[?rank=R&world_size=N]
//                                  rank 0 hosts the TCPStore server at host:port.
//   file:///path[?rank=R&world_size=N]
//                                  a FileStore at /path.
// `rank` and `world_size` arguments, when >= 0, take precedence over the URL and environment
// (env:// also accepts ?rank=&world_size=). No other query parameter is accepted.
// Every bad input (unknown scheme, unknown query parameter, missing or out-of-range rank or
// world size, missing host, bad port) throws InvalidArgument with a message naming the value
// and the init_method.
//
// Blocking: env:// and tcp:// return once all `world_size` ranks have joined the TCPStore
// (TCPStoreOptions::num_workers), or throw TimeoutError saying how many had after `timeout`.
// file:// does not wait; its FileStore gets num_workers = world_size, so the file is removed
// when the last rank's store is destroyed.

#include <memory>
#include <string>

#include "tdist/core/store.h"

namespace tdist {

struct RendezvousResult {
  std::shared_ptr<Store> store;
  int rank = 0;
  int world_size = 1;
};

RendezvousResult rendezvous(const std::string& init_method, int rank = -1, int world_size = -1,
                            Millis timeout = Store::kDefaultTimeout);

}  // namespace tdist
