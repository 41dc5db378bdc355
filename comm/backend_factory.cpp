// create_process_group: backend selection ("ring", "cpu:ring,cuda:nccl") and the group's store
// prefix. The name-to-factory map is explicit (no static registration).

#include <ATen/Context.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <vector>

#include "tdist/comm/device_dispatch.h"
#include "tdist/comm/ring/ring_process_group.h"
#include "tdist/comm/process_group.h"
#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"

namespace tdist::comm {
namespace {

std::shared_ptr<ProcessGroup> make_ring(std::shared_ptr<Store> store, std::string prefix, int rank,
                                        int size, const ProcessGroup::Options& opts) {
  return std::make_shared<detail::RingProcessGroup>(std::move(store), std::move(prefix), rank, size,
                                                    opts);
}

// Backends per device type (Note [Device dispatch] in comm/device_dispatch.h): the ring
// serves CUDA tensors too (staged through host memory); "nccl" is loaded when a group asks for it.
const std::map<std::string, std::vector<std::string>>& backends() {
  static const std::map<std::string, std::vector<std::string>> table = {
      {"cpu", {"ring"}},
      {"cuda", {"ring", "nccl"}},
  };
  return table;
}

bool known(const std::string& device, const std::string& name) {
  const auto& names = backends().at(device);
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::string known_names() {
  return "'auto', 'ring' (all devices) or per device type 'cpu:ring', 'cpu:ring,cuda:ring', "
         "'cpu:ring,cuda:nccl'";
}

// Parses the backend string into device type -> backend name and checks every entry.
std::map<std::string, std::string> parse_backend(const std::string& spec) {
  std::map<std::string, std::string> out;
  TDIST_CHECK_ARG(!spec.empty(), "empty backend name; expected ", known_names());
  if (spec.find(':') == std::string::npos) {
    TDIST_CHECK_ARG(known("cpu", spec), "unknown backend '", spec, "'; expected ", known_names());
    out["cpu"] = spec;
    return out;
  }
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    auto colon = item.find(':');
    TDIST_CHECK_ARG(colon != std::string::npos, "backend entry '", item, "' in '", spec,
                    "' is not of the form device:backend");
    std::string device = item.substr(0, colon);
    std::string name = item.substr(colon + 1);
    auto dev = backends().find(device);
    TDIST_CHECK_ARG(dev != backends().end(), "unknown device type '", device, "' in backend '",
                    spec, "'; expected cpu or cuda");
    TDIST_CHECK_ARG(known(device, name), "backend '", name, "' is not available for ", device,
                    " (backend string '", spec, "'); expected ", known_names());
    TDIST_CHECK_ARG(out.count(device) == 0, "device type '", device, "' appears twice in '", spec,
                    "'");
    out[device] = name;
  }
  TDIST_CHECK_ARG(out.count("cpu") != 0, "backend '", spec, "' names no CPU backend");
  return out;
}

// "auto" (the default): NCCL for CUDA tensors when this process sees a GPU and the NCCL backend
// loads, as c10d does (unless TDIST_CUDA_BACKEND=ring); else the ring for every device.
std::string resolve_auto(int rank) {
  const std::string cuda = env::get("TDIST_CUDA_BACKEND").value_or("nccl");
  TDIST_CHECK_ARG(cuda == "nccl" || cuda == "ring",
                  "TDIST_CUDA_BACKEND must be nccl or ring, got '", cuda, "'");
  if (cuda == "ring" || !at::hasCUDA()) return "ring";
  try {
    detail::load_nccl_backend();
    return "cpu:ring,cuda:nccl";
  } catch (const std::exception& e) {
    TDIST_LOG_WARN("rank ", rank,
                   ": a GPU is visible but the NCCL backend is not available, so "
                   "CUDA tensors are staged through the ring backend: ",
                   e.what());
    return "ring";
  }
}

}  // namespace

std::shared_ptr<ProcessGroup> create_process_group(std::shared_ptr<Store> store, int rank, int size,
                                                   ProcessGroup::Options opts) {
  TDIST_CHECK_ARG(store != nullptr, "create_process_group: the store is null");
  TDIST_CHECK_ARG(size >= 1, "create_process_group: world size must be >= 1, got ", size);
  TDIST_CHECK_ARG(rank >= 0 && rank < size, "create_process_group: rank ", rank, " is not in [0, ",
                  size, ")");
  TDIST_CHECK_ARG(!opts.device_id || *opts.device_id >= 0,
                  "create_process_group: device_id must be >= 0, got ", opts.device_id.value_or(0));
  const bool automatic = opts.backend == "auto";
  if (automatic) opts.backend = resolve_auto(rank);
  auto chosen = parse_backend(opts.backend);
  // Every rank counts the groups it created on this store; creation order matches across
  // ranks (as in c10d), so the n-th group of every rank gets the same prefix.
  int64_t generation = store->add(str("tdist/pg_generation/rank", rank), 1);
  std::string prefix = str("tdist/pg", generation);
  auto cuda = chosen.find("cuda");
  if (cuda == chosen.end() || cuda->second == "ring") {
    return make_ring(std::move(store), std::move(prefix), rank, size, opts);
  }
  detail::BackendFactory make_nccl = detail::load_nccl_backend();
  auto cpu_group = make_ring(store, prefix, rank, size, opts);
  std::shared_ptr<ProcessGroup> cuda_group;
  try {
    cuda_group = make_nccl(std::move(store), prefix + "/nccl", rank, size, opts);
  } catch (const std::exception& e) {
    if (automatic) {  // the ring serves CUDA tensors too
      TDIST_LOG_WARN("rank ", rank,
                     ": the nccl backend cannot start, so CUDA tensors are staged "
                     "through the ring backend: ",
                     e.what());
      return cpu_group;
    }
    TDIST_THROW(InvalidArgument, "backend '", opts.backend, "': the nccl backend cannot start on ",
                "rank ", rank, ": ", e.what());
  }
  return std::make_shared<detail::DispatchProcessGroup>(std::move(cpu_group), std::move(cuda_group),
                                                        opts);
}

}  // namespace tdist::comm
