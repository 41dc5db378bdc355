#pragma once
// The one symbol libtdist_comm_nccl.so exports for create_process_group, which loads the library
// only when a backend string names "cuda:nccl" (Note [Device dispatch] in comm/device_dispatch.h):
// `extern "C" BackendFactory tdist_comm_nccl_factory()`. Declared here, below the dispatch that
// looks it up, so the NCCL backend never includes the layer above it.

#include <memory>
#include <string>

#include "tdist/comm/process_group.h"

namespace tdist::comm::nccl {

using BackendFactory = std::shared_ptr<ProcessGroup> (*)(std::shared_ptr<Store> store,
                                                         std::string prefix, int rank, int size,
                                                         const ProcessGroup::Options& opts);

// The name of the exported function returning the factory.
inline constexpr const char* kFactorySymbol = "tdist_comm_nccl_factory";

}  // namespace tdist::comm::nccl
