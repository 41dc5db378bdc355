#pragma once
// The non-template halves of fsdp/checkpoint.h's functions, on the unit's state and root module
// (defined in fsdp/checkpoint.cpp). Not an API.

#include <map>
#include <string>

#include "tdist/fsdp/detail/fsdp_state.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace tdist::fsdp {

namespace detail {
void save_sharded(const std::string& dir, FSDPState& state, const torch::nn::Module& root,
                  const torch::optim::Optimizer* optimizer);
void load_sharded(const std::string& dir, FSDPState& state, torch::nn::Module& root,
                  torch::optim::Optimizer* optimizer);
void save_consolidated(FSDPState& state, const torch::nn::Module& root, const std::string& path,
                       const std::map<std::string, std::string>& metadata);
void load_consolidated(FSDPState& state, torch::nn::Module& root, const std::string& path);
}  // namespace detail

}  // namespace tdist::fsdp
