#pragma once
// fsdp's flat sharded parameter group as a building block for schedules that fully_shard does
// not fit: fully_shard expects one backward per forward, a pipeline stage runs the forwards of
// several microbatches before their backwards (apps/train/pipeline_strategy.cpp). A group is
// gathered with unshard() once per step, its gradients accumulate over every microbatch, and
// one reduce-scatter sends them to the shards. Its contract (layout, thread safety, blocking) is
// in tdist/fsdp/detail/param_group.h.

#include "tdist/fsdp/detail/param_group.h"

namespace tdist::fsdp {

using ParamGroup = detail::ParamGroup;
using ShardingConfig = detail::ShardingConfig;

}  // namespace tdist::fsdp
