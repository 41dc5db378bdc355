#include "tdist/fsdp/checkpoint.h"

#include <ATen/ATen.h>
#include <sys/stat.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>

#include "tdist/comm/process_group.h"
#include "tdist/core/atomic_file.h"
#include "tdist/core/error.h"
#include "tdist/core/token.h"
#include "tdist/fsdp/detail/param_group.h"

namespace tdist::fsdp::detail {
namespace {

using json = nlohmann::json;

constexpr const char* kFormat = "tdist.fsdp.sharded";
constexpr int kVersion = 1;
constexpr uint64_t kMaxIndexBytes = uint64_t(64) << 20;
constexpr const char* kBufferPrefix = "buffer/";

std::chrono::milliseconds timeout_of(const FSDPState& state) {
  return state.options().timeout.count() >= 0 ? state.options().timeout
                                              : state.process_group()->options().timeout;
}

// Every rank's int64 values (the same count on every rank), rank by rank.
std::vector<int64_t> allgather_ints(comm::ProcessGroup& pg, const std::vector<int64_t>& mine,
                                    std::chrono::milliseconds timeout) {
  const auto n = static_cast<int64_t>(mine.size());
  at::Tensor in = at::empty({n}, at::kLong);
  std::memcpy(in.data_ptr(), mine.data(), mine.size() * sizeof(int64_t));
  at::Tensor out = at::empty({n * pg.size()}, at::kLong);
  comm::AllgatherOptions ao;
  ao.timeout = timeout;
  pg.allgather_into_tensor(out, in, ao)->wait();
  const int64_t* p = out.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + out.numel());
}

// Note [Sharded checkpoints] 2: the ranks learn whether each succeeded; a rank that failed
// rethrows its own error, the others throw one naming it. Returns when all succeeded.
void agree(comm::ProcessGroup& pg, const std::exception_ptr& error,
           std::chrono::milliseconds timeout, const std::string& what) {
  const auto ok = allgather_ints(pg, {error ? 0 : 1}, timeout);
  if (error) std::rethrow_exception(error);
  std::string failed;
  for (size_t r = 0; r < ok.size(); ++r) {
    if (!ok[r]) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
  }
  if (!failed.empty()) {
    TDIST_THROW(Error, what, " failed on rank ", failed, " (see its error); nothing was changed");
  }
}

std::string shard_file(int rank, int world, const std::string& id) {
  return tdist::str("shard-", rank, "-of-", world, ".", id, ".safetensors");
}

// The optimizer kinds whose per-shard state a checkpoint carries (Note [Sharded checkpoints] 3).
std::string kind_of(const torch::optim::Optimizer& opt) {
  if (dynamic_cast<const torch::optim::AdamW*>(&opt)) return "adamw";
  if (dynamic_cast<const torch::optim::Adam*>(&opt)) return "adam";
  if (dynamic_cast<const torch::optim::SGD*>(&opt)) return "sgd";
  TDIST_THROW(InvalidArgument,
              "sharded checkpoints carry the state of Adam, AdamW and SGD only; "
              "save without the optimizer (nullptr) for another one");
}

void check_holds_shards(const torch::optim::Optimizer& opt, const FSDPState& state) {
  std::set<const void*> held;
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) held.insert(p.unsafeGetTensorImpl());
  }
  for (size_t g = 0; g < state.num_groups(); ++g) {
    TDIST_CHECK_ARG(held.count(state.group(g).sharded_param().unsafeGetTensorImpl()),
                    "the optimizer does not hold the shard of unit ", state.group(g).name(),
                    ": build it from the FullyShardedModule's parameters()");
  }
  TDIST_CHECK_ARG(held.size() == state.num_groups(), "the optimizer holds ", held.size(),
                  " tensors, the model has ", state.num_groups(),
                  " shards: build it from the FullyShardedModule's parameters() alone");
}

struct ShardOptState {
  int64_t step = 0;
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // empty: no state yet
};

ShardOptState opt_state_of(const torch::optim::Optimizer& opt, const std::string& kind,
                           const at::Tensor& shard) {
  ShardOptState out;
  auto it = opt.state().find(shard.unsafeGetTensorImpl());
  if (it == opt.state().end()) return out;
  auto add = [&](const char* name, const at::Tensor& t) {
    if (t.defined()) out.tensors.emplace_back(name, t.detach());
  };
  if (kind == "adam") {
    const auto& s = static_cast<const torch::optim::AdamParamState&>(*it->second);
    out.step = s.step();
    add("exp_avg", s.exp_avg());
    add("exp_avg_sq", s.exp_avg_sq());
    add("max_exp_avg_sq", s.max_exp_avg_sq());
  } else if (kind == "adamw") {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    out.step = s.step();
    add("exp_avg", s.exp_avg());
    add("exp_avg_sq", s.exp_avg_sq());
    add("max_exp_avg_sq", s.max_exp_avg_sq());
  } else {
    const auto& s = static_cast<const torch::optim::SGDParamState&>(*it->second);
    add("momentum_buffer", s.momentum_buffer());
  }
  return out;
}

void set_opt_state(torch::optim::Optimizer& opt, const std::string& kind, const at::Tensor& shard,
                   const ShardOptState& st) {
  void* key = shard.unsafeGetTensorImpl();
  if (st.tensors.empty()) {
    opt.state().erase(key);
    return;
  }
  std::map<std::string, at::Tensor> t;
  for (const auto& [name, v] : st.tensors) t[name] = v.to(shard.device());
  auto get = [&](const char* name) { return t.count(name) ? t.at(name) : at::Tensor(); };
  std::unique_ptr<torch::optim::OptimizerParamState> ps;
  if (kind == "adam") {
    auto s = std::make_unique<torch::optim::AdamParamState>();
    s->step(st.step);
    s->exp_avg(get("exp_avg"));
    s->exp_avg_sq(get("exp_avg_sq"));
    s->max_exp_avg_sq(get("max_exp_avg_sq"));
    ps = std::move(s);
  } else if (kind == "adamw") {
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(st.step);
    s->exp_avg(get("exp_avg"));
    s->exp_avg_sq(get("exp_avg_sq"));
    s->max_exp_avg_sq(get("max_exp_avg_sq"));
    ps = std::move(s);
  } else {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(get("momentum_buffer"));
    ps = std::move(s);
  }
  opt.state()[key] = std::move(ps);
}

// The state tensors each kind may have, in the order they are saved.
const std::vector<std::string>& state_names(const std::string& kind) {
  static const std::vector<std::string> adam = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  static const std::vector<std::string> sgd = {"momentum_buffer"};
  return kind == "sgd" ? sgd : adam;
}

std::vector<std::pair<std::string, at::Tensor>> buffers_of(const torch::nn::Module& root) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : root.named_buffers(/*recurse=*/true)) {
    if (item.value().defined()) out.emplace_back(item.key(), item.value());
  }
  return out;
}

Sha256Digest digest_of(const at::Tensor& host) {
  return sha256(host.data_ptr(), static_cast<size_t>(host.numel()) * host.element_size());
}

// The range of a group's flat vector that `rank` of `world` holds, cut at its real numel.
std::pair<int64_t, int64_t> shard_range(int64_t numel, int rank, int world) {
  const int64_t padded = (numel + world - 1) / world * world;
  const int64_t per = padded / world;
  return {std::min(numel, rank * per), std::min(numel, (rank + 1) * per)};
}

// ---- the index -------------------------------------------------------------------------------

// A field of the index, with an error naming the file when it is missing or of the wrong kind.
class IndexReader {
 public:
  explicit IndexReader(std::string path) : path_(std::move(path)) {}
  const json& at(const json& obj, const char* key) const {
    if (!obj.is_object() || !obj.contains(key)) damaged(tdist::str("no field '", key, "'"));
    return obj[key];
  }
  int64_t integer(const json& obj, const char* key) const {
    const json& v = at(obj, key);
    if (!v.is_number_integer()) damaged(tdist::str("'", key, "' is not an integer"));
    return v.get<int64_t>();
  }
  const std::string& string(const json& obj, const char* key) const {
    const json& v = at(obj, key);
    if (!v.is_string()) damaged(tdist::str("'", key, "' is not a string"));
    return v.get_ref<const std::string&>();
  }
  const json& array(const json& obj, const char* key) const {
    const json& v = at(obj, key);
    if (!v.is_array()) damaged(tdist::str("'", key, "' is not an array"));
    return v;
  }
  std::vector<int64_t> ints(const json& obj, const char* key) const {
    std::vector<int64_t> out;
    for (const json& v : array(obj, key)) {
      if (!v.is_number_integer()) damaged(tdist::str("'", key, "' holds a non-integer"));
      out.push_back(v.get<int64_t>());
    }
    return out;
  }
  [[noreturn]] void damaged(const std::string& what) const {
    TDIST_THROW(Error, "the checkpoint index '", path_, "' is damaged: ", what);
  }

 private:
  std::string path_;
};

json read_index(const std::string& dir, const IndexReader& r) {
  const std::string path = dir + "/" + kIndexFile;
  auto bytes = read_file(path, kMaxIndexBytes);
  if (!bytes)
    TDIST_THROW(Error, "no sharded checkpoint in '", dir, "' (", kIndexFile, " is missing)");
  json index;
  try {
    index = json::parse(bytes->begin(), bytes->end());
  } catch (const json::exception& e) {
    r.damaged(tdist::str("not JSON (", e.what(), ")"));
  }
  if (r.string(index, "format") != kFormat) r.damaged("not a tdist sharded checkpoint index");
  if (r.integer(index, "version") != kVersion) {
    r.damaged(
        tdist::str("version ", index["version"].dump(), "; this build reads version ", kVersion));
  }
  return index;
}

// Note [Sharded checkpoints] 2: the index's groups must be the model's.
void check_groups(const json& index, const FSDPState& state, const IndexReader& r) {
  const json& groups = r.array(index, "groups");
  TDIST_CHECK_ARG(groups.size() == state.num_groups(), "the checkpoint has ", groups.size(),
                  " sharded units, the model ", state.num_groups(),
                  ": shard the model with the same fully_shard units");
  for (size_t g = 0; g < groups.size(); ++g) {
    const ParamGroup& pg = state.group(g);
    const json& jg = groups[g];
    const std::string& name = r.string(jg, "name");
    TDIST_CHECK_ARG(name == pg.name(), "the checkpoint's unit ", g, " is ", name,
                    ", the model's is ", pg.name());
    TDIST_CHECK_ARG(r.string(jg, "dtype") == safetensors_dtype(pg.sharded_param().scalar_type()),
                    "unit ", name, " was saved as ", r.string(jg, "dtype"), ", the model's is ",
                    pg.sharded_param().scalar_type());
    TDIST_CHECK_ARG(r.integer(jg, "numel") == pg.numel(), "unit ", name, " has ",
                    r.integer(jg, "numel"), " elements in the checkpoint, ", pg.numel(),
                    " in the model");
    const json& params = r.array(jg, "params");
    TDIST_CHECK_ARG(params.size() == pg.param_names().size(), "unit ", name, " has ", params.size(),
                    " parameters in the checkpoint, ", pg.param_names().size(), " in the model");
    for (size_t i = 0; i < params.size(); ++i) {
      const std::string& pname = r.string(params[i], "name");
      TDIST_CHECK_ARG(pname == pg.param_names()[i], "unit ", name, "'s parameter ", i, " is ",
                      pname, " in the checkpoint, ", pg.param_names()[i], " in the model");
      TDIST_CHECK_ARG(r.ints(params[i], "shape") == pg.shapes()[i] &&
                          r.integer(params[i], "offset") == pg.offsets()[i],
                      "parameter ", pname, " has shape ", params[i]["shape"].dump(),
                      " in the checkpoint, ", c10::IntArrayRef(pg.shapes()[i]), " in the model");
    }
  }
}

Sha256Digest digest_from_hex(const std::string& hex, const IndexReader& r) {
  Sha256Digest d{};
  if (hex.size() != 64) r.damaged("a digest is not 64 hex digits");
  for (size_t i = 0; i < d.size(); ++i) {
    auto nib = [&](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      r.damaged("a digest is not hex");
    };
    d[i] = static_cast<uint8_t>(nib(hex[2 * i]) * 16 + nib(hex[2 * i + 1]));
  }
  return d;
}

// The old ranks' shard files, opened when first needed; each tensor read whole and checked
// against its digest in the index.
class ShardFiles {
 public:
  ShardFiles(std::string dir, const json& index, const IndexReader& r)
      : dir_(std::move(dir)), files_(r.array(index, "files")), r_(r) {}

  at::Tensor read(int rank, const std::string& tensor) {
    auto key = std::make_pair(rank, tensor);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    SafetensorsReader& reader = open(rank);
    const json& digests = r_.at(files_[rank], "sha256");
    if (!digests.contains(tensor) || !digests[tensor].is_string()) {
      r_.damaged(tdist::str("no digest of '", tensor, "' in file ", rank));
    }
    const SafetensorsEntry* e = reader.header().find(tensor);
    if (e == nullptr) {
      TDIST_THROW(Error, "checkpoint file '", reader.path(), "' has no tensor '", tensor,
                  "' (a damaged or foreign file)");
    }
    at::Tensor t = reader.read(tensor);
    if (digest_of(t) != digest_from_hex(digests[tensor].get<std::string>(), r_)) {
      TDIST_THROW(Error, "tensor '", tensor, "' of checkpoint file '", reader.path(),
                  "' does not match its SHA-256 in the index (a damaged file)");
    }
    cache_[key] = t;
    return t;
  }

 private:
  SafetensorsReader& open(int rank) {
    auto it = readers_.find(rank);
    if (it != readers_.end()) return *it->second;
    TDIST_CHECK(rank >= 0 && static_cast<size_t>(rank) < files_.size(), "no file of rank ", rank);
    const std::string path = dir_ + "/" + r_.string(files_[rank], "name");
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      TDIST_THROW(Error, "checkpoint file '", path, "' is missing (", std::strerror(errno), ")");
    }
    const int64_t expected = r_.integer(files_[rank], "bytes");
    if (st.st_size != expected) {
      TDIST_THROW(Error, "checkpoint file '", path, "' has ", st.st_size, " bytes, the index says ",
                  expected, " (truncated or replaced)");
    }
    auto reader = std::make_unique<SafetensorsReader>(path);
    return *(readers_[rank] = std::move(reader));
  }

  const std::string dir_;
  const json& files_;
  const IndexReader& r_;
  std::map<int, std::unique_ptr<SafetensorsReader>> readers_;
  std::map<std::pair<int, std::string>, at::Tensor> cache_;
};

}  // namespace

// ---- save -------------------------------------------------------------------------------------

namespace {

// HSDP: the replicas hold the same shards, so the ranks of replica 0 alone write (`write` runs
// there, as a collective of its shard group); the other replicas then learn from replica 0 of
// their shard whether it succeeded. Without replicas, `write` runs everywhere.
void on_replica_zero(FSDPState& state, const std::function<void()>& write,
                     const std::string& what) {
  const auto& replicas = state.replicate_group();
  const bool writer = !replicas || replicas->rank() == 0;
  std::exception_ptr error;
  if (writer) {
    try {
      write();
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (replicas && replicas->size() > 1) {
    at::Tensor ok = at::full({1}, error ? 0 : 1, at::kLong);
    comm::BroadcastOptions bo;
    bo.timeout = timeout_of(state);
    replicas->broadcast(ok, bo)->wait();
    if (error) std::rethrow_exception(error);
    if (ok[0].item<int64_t>() == 0) {
      TDIST_THROW(Error, what, " failed on replica 0 of this rank's shard (see its error)");
    }
  }
  if (error) std::rethrow_exception(error);
}

void save_shards(const std::string& dir, FSDPState& state, const torch::nn::Module& root,
                 const torch::optim::Optimizer* optimizer) {
  comm::ProcessGroup& pg = *state.process_group();
  const int rank = pg.rank();
  const int world = pg.size();
  const auto timeout = timeout_of(state);
  // The same model and optimizer on every rank: these throw alike everywhere, before any
  // collective.
  const std::string kind = optimizer ? kind_of(*optimizer) : "";
  if (optimizer) check_holds_shards(*optimizer, state);

  // 1. The checkpoint's id, drawn by rank 0.
  at::Tensor id_t = at::zeros({1}, at::kLong);
  if (rank == 0) id_t[0] = static_cast<int64_t>(std::stoull(random_hex(8), nullptr, 16) >> 1);
  comm::BroadcastOptions bo;
  bo.timeout = timeout;
  pg.broadcast(id_t, bo)->wait();
  char id[17];
  std::snprintf(id, sizeof(id), "%016llx",
                static_cast<unsigned long long>(id_t[0].item<int64_t>()));

  NamedTensors tensors;
  std::vector<ShardOptState> opt_states;
  for (size_t g = 0; g < state.num_groups(); ++g) {
    const ParamGroup& group = state.group(g);
    tensors.emplace_back(group.name() + "/param", group.sharded_param().detach());
    if (optimizer) {
      opt_states.push_back(opt_state_of(*optimizer, kind, group.sharded_param()));
      for (const auto& [name, t] : opt_states.back().tensors) {
        tensors.emplace_back(group.name() + "/" + name, t);
      }
    }
  }
  const auto buffers = buffers_of(root);
  if (rank == 0) {
    for (const auto& [name, t] : buffers) tensors.emplace_back(kBufferPrefix + name, t);
  }
  const std::string file = shard_file(rank, world, id);
  std::exception_ptr error;
  std::vector<int64_t> digests;  // 4 per tensor, in `tensors` order
  int64_t file_bytes = 0;
  try {
    const std::string bytes = encode_safetensors(tensors);
    const SafetensorsHeader h = parse_safetensors(bytes.data(), bytes.size());
    for (const auto& [name, t] : tensors) {
      const SafetensorsEntry* e = h.find(name);
      const Sha256Digest d = sha256(bytes.data() + h.data_offset + e->begin, e->end - e->begin);
      int64_t words[4];
      std::memcpy(words, d.data(), d.size());
      digests.insert(digests.end(), words, words + 4);
    }
    file_bytes = static_cast<int64_t>(bytes.size());
    write_file_atomically(dir + "/" + file, {std::string_view(bytes)});
  } catch (...) {
    error = std::current_exception();
  }
  // Every rank's success, file size and tensor count; then the digests (padded to the longest:
  // rank 0 also has the buffers).
  const auto status = allgather_ints(
      pg, {error ? 0 : 1, file_bytes, static_cast<int64_t>(tensors.size())}, timeout);
  agree(pg, error, timeout, "saving the sharded checkpoint in '" + dir + "'");
  int64_t most = 0;
  for (int r = 0; r < world; ++r) most = std::max(most, status[3 * r + 2]);
  digests.resize(static_cast<size_t>(most) * 4, 0);
  const auto all_digests = allgather_ints(pg, digests, timeout);

  // 2. Rank 0's index.
  error = nullptr;
  if (rank == 0) {
    try {
      json index;
      index["format"] = kFormat;
      index["version"] = kVersion;
      index["world_size"] = world;
      index["id"] = id;
      index["optimizer"] = optimizer ? json(kind) : json(nullptr);
      json groups = json::array();
      for (size_t g = 0; g < state.num_groups(); ++g) {
        const ParamGroup& group = state.group(g);
        json jg;
        jg["name"] = group.name();
        jg["dtype"] = safetensors_dtype(group.sharded_param().scalar_type());
        jg["numel"] = group.numel();
        jg["padded_numel"] = group.padded_numel();
        json params = json::array();
        for (size_t i = 0; i < group.param_names().size(); ++i) {
          params.push_back({{"name", group.param_names()[i]},
                            {"shape", group.shapes()[i]},
                            {"offset", group.offsets()[i]}});
        }
        jg["params"] = params;
        if (optimizer) {
          json names = json::array();
          for (const auto& [name, t] : opt_states[g].tensors) names.push_back(name);
          jg["optimizer"] = {{"step", opt_states[g].step}, {"tensors", names}};
        }
        groups.push_back(jg);
      }
      index["groups"] = groups;
      json jbuffers = json::array();
      for (const auto& [name, t] : buffers) jbuffers.push_back(name);
      index["buffers"] = jbuffers;
      json files = json::array();
      std::set<std::string> kept;
      for (int r = 0; r < world; ++r) {
        const int64_t count = status[3 * r + 2];
        const size_t expected = tensors.size() - (r == 0 ? 0 : buffers.size());
        TDIST_CHECK(count == static_cast<int64_t>(expected), "rank ", r, " wrote ", count,
                    " tensors, rank 0 expected ", expected,
                    " (the ranks' optimizers hold different state)");
        json sums = json::object();
        for (int64_t t = 0; t < count; ++t) {  // rank r's tensors are rank 0's first `count`
          Sha256Digest d;
          std::memcpy(d.data(), &all_digests[static_cast<size_t>(r * most + t) * 4], d.size());
          sums[tensors[t].first] = to_hex(d);
        }
        const std::string name = shard_file(r, world, id);
        kept.insert(name);
        files.push_back({{"name", name}, {"bytes", status[3 * r + 1]}, {"sha256", sums}});
      }
      index["files"] = files;
      const std::string text = index.dump(1);
      write_file_atomically(dir + "/" + kIndexFile, {std::string_view(text)});
      // The shard files of earlier checkpoints (any id, any world size), and temporary files
      // that interrupted saves left, are garbage now.
      std::error_code ec;
      for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
        const std::string n = entry.path().filename().string();
        const bool shard = n.rfind("shard-", 0) == 0 &&
                           ((n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0) ||
                            n.find(".safetensors.tmp.") != std::string::npos);
        if (shard && !kept.count(n)) std::filesystem::remove(entry.path(), ec);
      }
    } catch (...) {
      error = std::current_exception();
    }
  }
  agree(pg, error, timeout, "writing the sharded checkpoint's index in '" + dir + "'");
}

}  // namespace

void save_sharded(const std::string& dir, FSDPState& state, const torch::nn::Module& root,
                  const torch::optim::Optimizer* optimizer) {
  on_replica_zero(
      state, [&] { save_shards(dir, state, root, optimizer); },
      "saving the sharded checkpoint in '" + dir + "'");
}

// ---- load -------------------------------------------------------------------------------------

void load_sharded(const std::string& dir, FSDPState& state, torch::nn::Module& root,
                  torch::optim::Optimizer* optimizer) {
  comm::ProcessGroup& pg = *state.process_group();
  const int rank = pg.rank();
  const int world = pg.size();
  const auto timeout = timeout_of(state);
  const IndexReader r(dir + "/" + kIndexFile);

  std::string kind;
  std::vector<at::Tensor> params(state.num_groups());
  std::vector<ShardOptState> opt_states(state.num_groups());
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers;  // the module's, the loaded value
  std::exception_ptr error;
  try {
    const json index = read_index(dir, r);
    check_groups(index, state, r);
    const int64_t old_world = r.integer(index, "world_size");
    if (old_world < 1 || r.array(index, "files").size() != static_cast<size_t>(old_world)) {
      r.damaged("world_size does not match the files it lists");
    }
    const json& saved_kind = r.at(index, "optimizer");
    if (optimizer) {
      kind = kind_of(*optimizer);
      check_holds_shards(*optimizer, state);
      TDIST_CHECK_ARG(!saved_kind.is_null(), "the checkpoint in '", dir,
                      "' holds no optimizer state (it was saved without an optimizer)");
      TDIST_CHECK_ARG(saved_kind.is_string() && saved_kind.get<std::string>() == kind,
                      "the checkpoint holds the state of ", saved_kind.dump(),
                      ", the optimizer is ", kind);
    }
    ShardFiles files(dir, index, r);
    const json& groups = index["groups"];
    for (size_t g = 0; g < state.num_groups(); ++g) {
      const ParamGroup& group = state.group(g);
      const at::Tensor& shard = group.sharded_param();
      const int64_t numel = group.numel();
      const auto [lo, hi] = shard_range(numel, rank, world);
      const int64_t shard_begin = rank * shard.numel();
      std::vector<std::string> names = {"param"};
      if (optimizer) {
        const json& jo = r.at(groups[g], "optimizer");
        opt_states[g].step = r.integer(jo, "step");
        for (const json& n : r.array(jo, "tensors")) {
          if (!n.is_string()) r.damaged("an optimizer tensor's name is not a string");
          const auto& allowed = state_names(kind);
          if (std::find(allowed.begin(), allowed.end(), n.get<std::string>()) == allowed.end()) {
            r.damaged("unknown optimizer tensor " + n.dump());
          }
          names.push_back(n.get<std::string>());
        }
      }
      for (const auto& name : names) {
        at::Tensor value =
            at::zeros({shard.numel()}, at::TensorOptions().dtype(shard.scalar_type()));
        // Old rank k held [k * old_per, (k + 1) * old_per) of the flat vector.
        const int64_t old_per = (numel + old_world - 1) / old_world;
        for (int64_t k = lo / old_per; k < old_world && k * old_per < hi; ++k) {
          const int64_t a = std::max(lo, k * old_per);
          const int64_t b = std::min(hi, (k + 1) * old_per);
          at::Tensor old = files.read(static_cast<int>(k), group.name() + "/" + name);
          TDIST_CHECK(
              old.dim() == 1 && old.scalar_type() == shard.scalar_type() && old.numel() == old_per,
              "checkpoint tensor ", group.name(), "/", name, " of rank ", k, " is ",
              old.scalar_type(), " ", old.sizes(), ", not ", shard.scalar_type(), " [", old_per,
              "] (a damaged or foreign file)");
          value.narrow(0, a - shard_begin, b - a).copy_(old.narrow(0, a - k * old_per, b - a));
        }
        if (name == "param") {
          params[g] = value;
        } else {
          opt_states[g].tensors.emplace_back(name, value);
        }
      }
    }
    std::set<std::string> saved_buffers;
    for (const json& b : r.array(index, "buffers")) {
      if (!b.is_string()) r.damaged("a buffer's name is not a string");
      saved_buffers.insert(b.get<std::string>());
    }
    for (const auto& [name, t] : buffers_of(root)) {
      TDIST_CHECK_ARG(saved_buffers.count(name), "the checkpoint has no buffer ", name);
      at::Tensor v = files.read(0, kBufferPrefix + name);
      TDIST_CHECK_ARG(v.sizes() == t.sizes() && v.scalar_type() == t.scalar_type(), "buffer ", name,
                      " is ", v.scalar_type(), " ", v.sizes(), " in the checkpoint, ",
                      t.scalar_type(), " ", t.sizes(), " in the model");
      buffers.emplace_back(t, v);
    }
    TDIST_CHECK_ARG(saved_buffers.size() == buffers.size(), "the checkpoint has ",
                    saved_buffers.size(), " buffers, the model ", buffers.size());
  } catch (...) {
    error = std::current_exception();
  }
  agree(pg, error, timeout, "loading the sharded checkpoint in '" + dir + "'");

  at::NoGradGuard no_grad;
  for (size_t g = 0; g < state.num_groups(); ++g) {
    const at::Tensor& shard = state.group(g).sharded_param();
    shard.copy_(params[g]);
    if (optimizer) set_opt_state(*optimizer, kind, shard, opt_states[g]);
  }
  for (auto& [t, v] : buffers) t.copy_(v);
}

// ---- consolidated safetensors -------------------------------------------------------------------

namespace {

void write_consolidated(FSDPState& state, const torch::nn::Module& root, const std::string& path,
                        const std::map<std::string, std::string>& metadata) {
  comm::ProcessGroup& pg = *state.process_group();
  std::unordered_map<const void*, at::Tensor> full;
  for (size_t g = 0; g < state.num_groups(); ++g) {
    const ParamGroup& group = state.group(g);
    auto values = group.gather_full();  // a collective, on every rank
    if (pg.rank() != 0) continue;
    for (size_t i = 0; i < values.size(); ++i) {
      full[group.params()[i].unsafeGetTensorImpl()] = values[i];
    }
  }
  const bool writer = pg.rank() == 0;
  std::exception_ptr error;
  if (writer) {
    try {
      NamedTensors tensors;
      for (const auto& item : root.named_parameters(/*recurse=*/true)) {
        auto it = full.find(item.value().unsafeGetTensorImpl());
        TDIST_CHECK(it != full.end(), "parameter ", item.key(), " is in no sharded group");
        tensors.emplace_back(item.key(), it->second);
      }
      for (const auto& b : buffers_of(root)) tensors.push_back(b);
      save_safetensors(path, tensors, metadata);
    } catch (...) {
      error = std::current_exception();
    }
  }
  agree(pg, error, timeout_of(state), "writing '" + path + "'");
}

}  // namespace

void save_consolidated(FSDPState& state, const torch::nn::Module& root, const std::string& path,
                       const std::map<std::string, std::string>& metadata) {
  on_replica_zero(
      state, [&] { write_consolidated(state, root, path, metadata); }, "writing '" + path + "'");
}

void load_consolidated(FSDPState& state, torch::nn::Module& root, const std::string& path) {
  comm::ProcessGroup& pg = *state.process_group();
  std::vector<at::Tensor> params(state.num_groups());
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers;
  std::exception_ptr error;
  try {
    SafetensorsReader reader(path);
    // The module's names, shapes and dtypes (the parameters' shapes from their groups: at rest
    // the module's own parameters are empty).
    std::unordered_map<const void*, std::pair<size_t, size_t>> where;  // impl -> group, index
    for (size_t g = 0; g < state.num_groups(); ++g) {
      for (size_t i = 0; i < state.group(g).params().size(); ++i) {
        where[state.group(g).params()[i].unsafeGetTensorImpl()] = {g, i};
      }
    }
    std::map<std::pair<size_t, size_t>, std::string> name_of;
    std::string problems;
    std::set<std::string> wanted;
    auto check = [&](const std::string& name, c10::IntArrayRef shape, at::ScalarType dtype) {
      wanted.insert(name);
      const SafetensorsEntry* e = reader.header().find(name);
      if (e == nullptr) {
        problems += "\n  missing: " + name;
      } else if (c10::IntArrayRef(e->shape) != shape || e->dtype != dtype) {
        problems += tdist::str("\n  ", name, ": the file has ", safetensors_dtype(e->dtype), " ",
                               c10::IntArrayRef(e->shape), ", the module ", dtype, " ", shape);
      }
    };
    for (const auto& item : root.named_parameters(/*recurse=*/true)) {
      const auto [g, i] = where.at(item.value().unsafeGetTensorImpl());
      check(item.key(), state.group(g).shapes()[i], state.group(g).sharded_param().scalar_type());
      name_of.emplace(std::make_pair(g, i), item.key());
    }
    for (const auto& [name, t] : buffers_of(root)) check(name, t.sizes(), t.scalar_type());
    for (const auto& e : reader.header().tensors) {
      if (!wanted.count(e.name)) problems += "\n  not in the module: " + e.name;
    }
    if (!problems.empty()) {
      throw InvalidArgument(
          tdist::str("'", path, "' does not match the module (nothing was loaded):", problems));
    }
    for (size_t g = 0; g < state.num_groups(); ++g) {
      const ParamGroup& group = state.group(g);
      const at::Tensor& shard = group.sharded_param();
      const auto [lo, hi] = shard_range(group.numel(), pg.rank(), pg.size());
      const int64_t shard_begin = pg.rank() * shard.numel();
      at::Tensor value = at::zeros({shard.numel()}, at::TensorOptions().dtype(shard.scalar_type()));
      for (size_t i = 0; i < group.params().size(); ++i) {
        const int64_t begin = group.offsets()[i];
        const int64_t end = begin + c10::multiply_integers(group.shapes()[i]);
        const int64_t a = std::max(lo, begin);
        const int64_t b = std::min(hi, end);
        if (a >= b) continue;
        value.narrow(0, a - shard_begin, b - a)
            .copy_(reader.read_elements(name_of.at({g, i}), a - begin, b - a));
      }
      params[g] = value;
    }
    for (const auto& [name, t] : buffers_of(root)) buffers.emplace_back(t, reader.read(name));
  } catch (...) {
    error = std::current_exception();
  }
  agree(pg, error, timeout_of(state), "loading '" + path + "'");
  at::NoGradGuard no_grad;
  for (size_t g = 0; g < state.num_groups(); ++g) state.group(g).sharded_param().copy_(params[g]);
  for (auto& [t, v] : buffers) t.copy_(v);
}

}  // namespace tdist::fsdp::detail
