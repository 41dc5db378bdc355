#pragma once
// Checkpoints of a FullyShardedModule: sharded (each rank writes its shards; loadable at another
// world size) and consolidated safetensors files (Note [safetensors format] in
// tdist/fsdp/safetensors.h) that PyTorch users open with safetensors.torch.load_file.
//
//   fsdp::save_sharded_checkpoint("ckpt", model, &adam);   // every rank, after a step
//   ...                                                    // later, at any world size:
//   fsdp::load_sharded_checkpoint("ckpt", model, &adam);   // model: fully_shard(...) alike
//   fsdp::save_safetensors(model, "model.safetensors");   // full parameters, rank 0 writes
//   fsdp::load_safetensors(model, "model.safetensors");   // each rank reads its shard
//
// Note [Sharded checkpoints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A group's flat layout (Note [Sharded data parallel]: its parameters back to back, P elements
// padded to a multiple of the world size N, rank r holding [r*P/N, (r+1)*P/N)) does not depend
// on N but for the padding, so a shard saved at world N is a byte range of the same flat vector
// a rank at world M needs a range of.
//  1. Save (a collective). Rank 0 draws the checkpoint's id (random, broadcast). Each rank r
//     writes shard-<r>-of-<N>.<id>.safetensors atomically: per group "<group>/param" (its shard
//     of the parameters) and the optimizer's state of that shard ("<group>/exp_avg",
//     "<group>/exp_avg_sq", "<group>/max_exp_avg_sq" for Adam and AdamW; "<group>/momentum_buffer"
//     for SGD); rank 0 also the module's buffers ("buffer/<name>"; buffers are not sharded, every
//     rank holds the same). Each rank hashes every tensor it wrote (SHA-256) and the ranks
//     allgather whether they succeeded, their file's size and the digests. Then rank 0 writes
//     index.json atomically: world size, id, per group its name, dtype, numel, padded numel and
//     each parameter's name, shape and offset, the optimizer's kind and per group its step and
//     state tensors, the buffers, and per file its name, size and digests. Last it removes the
//     shard files of earlier checkpoints in the directory, and broadcasts whether all went well.
//     Until index.json is renamed the previous checkpoint (its index and its files, which have
//     another id) is intact: a crash at any point leaves one whole checkpoint.
//  2. Load (a collective, any world size M; the directory readable by every rank: a shared file
//     system or one machine). Every rank reads index.json and checks it against the model: the
//     same groups, dtypes, parameter names, shapes and offsets (the same fully_shard units),
//     else InvalidArgument naming the difference. Rank r at world M needs [r*S', (r+1)*S') of
//     each group's flat vector (S' = its padded numel at M / M), cut at the real numel; it opens
//     only the files of the old ranks whose shards overlap that range (checking each file's size
//     against the index), reads those old shards' tensors, checks each against its digest, and
//     copies the overlap (the padding stays zero). The buffers come from rank 0's file. Nothing
//     is changed until every rank has read and checked all it needs: the ranks allgather
//     whether they succeeded, and all throw (naming the failed rank) or all assign.
//  3. The optimizer: the kind (Adam, AdamW, SGD) must be the one saved; its options (lr, betas,
//     ...) are not saved (the code that builds it sets them); its state for each shard is
//     replaced by the loaded one (the step of Adam is the same on every rank, saved once per
//     group). An optimizer that has no state yet (no step) saves none, and loading such a
//     checkpoint leaves the optimizer's state empty. The optimizer must hold exactly the
//     model's shards (built from model.parameters()).
//  4. HSDP: the replicas hold the same shards; the ranks of replica 0 (the shard group of
//     global rank 0) alone run 1, as a collective of their shard group, and then tell the
//     other replicas of their shard whether it succeeded (a broadcast over the replicate
//     group): the checkpoint has as many shards as a shard group has ranks. Every replica
//     loads (2) on its own. Mixed precision: the shards saved and loaded are the master copies
//     in their own dtype.
// Errors: a missing index ("no checkpoint"), a damaged index (not JSON, fields missing or of
// the wrong type), a missing or truncated shard file, a tensor that fails its digest: Error
// naming the file; a model or optimizer that does not match: InvalidArgument.
//
// Consolidated safetensors: save_safetensors gathers every group's full parameters (on every
// rank, one group at a time) and rank 0 writes them with the module's buffers by their module
// names (module->named_parameters(), named_buffers()); load_safetensors reads on every rank
// only the elements of its shard (and the buffers). Both are collectives and end with the
// ranks agreeing on success, as above (under HSDP replica 0 writes, as in 4); the file must be
// readable by every rank to load.
//
// Blocking: all of these are collectives bounded by the FSDPOptions' timeout (else the
// group's) plus the file I/O. Call them between steps (not during forward or backward).

#include <map>
#include <string>

#include "tdist/fsdp/detail/checkpoint_io.h"
#include "tdist/fsdp/fully_shard.h"
#include "tdist/fsdp/safetensors.h"

namespace torch::optim {
class Optimizer;
}

namespace tdist::fsdp {

inline constexpr const char* kIndexFile = "index.json";

// Writes the model's shards (and the optimizer's state of them, when given) into `dir`
// (created if needed), with rank 0's index.json (Note [Sharded checkpoints] 1). A collective.
template <typename M>
void save_sharded_checkpoint(const std::string& dir, FullyShardedModule<M>& model,
                             const torch::optim::Optimizer* optimizer = nullptr) {
  detail::save_sharded(dir, model.state(), *detail::module_ptr(model.module()), optimizer);
}

// Loads a sharded checkpoint written at any world size into `model` (and `optimizer`'s state,
// when given) (Note [Sharded checkpoints] 2, 3). A collective.
template <typename M>
void load_sharded_checkpoint(const std::string& dir, FullyShardedModule<M>& model,
                             torch::optim::Optimizer* optimizer = nullptr) {
  detail::load_sharded(dir, model.state(), *detail::module_ptr(model.module()), optimizer);
}

// A collective: rank 0 writes the full parameters and the buffers by their module names.
template <typename M>
void save_safetensors(FullyShardedModule<M>& model, const std::string& path,
                      const std::map<std::string, std::string>& metadata = {}) {
  detail::save_consolidated(model.state(), *detail::module_ptr(model.module()), path, metadata);
}

// A collective: each rank loads its shard of every parameter, and the buffers, from a file
// holding exactly the module's names, shapes and dtypes (else InvalidArgument; nothing loaded).
template <typename M>
void load_safetensors(FullyShardedModule<M>& model, const std::string& path) {
  detail::load_consolidated(model.state(), *detail::module_ptr(model.module()), path);
}

}  // namespace tdist::fsdp
