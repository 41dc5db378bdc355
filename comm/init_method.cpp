// create_process_group from an init_method URL (rendezvous.h).

#include "tdist/comm/process_group.h"
#include "tdist/core/rendezvous.h"

namespace tdist::comm {

std::shared_ptr<ProcessGroup> create_process_group(const std::string& init_method, int rank,
                                                   int size, ProcessGroup::Options opts) {
  auto rv = rendezvous(init_method, rank, size, opts.timeout);
  return create_process_group(std::move(rv.store), rv.rank, rv.world_size, std::move(opts));
}

}  // namespace tdist::comm
