#include "tdist/ddp/model_sync.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <limits>
#include <map>
#include <sstream>
#include <tuple>

#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"
#include "tdist/core/wire.h"

namespace tdist::ddp {

std::string TensorSignature::describe() const {
  std::ostringstream os;
  os << kind << " " << name << ": " << dtype << " [";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

TensorSignature signature_of(std::string kind, std::string name, const at::Tensor& t) {
  return TensorSignature{std::move(kind), std::move(name),
                         std::string(c10::toString(t.scalar_type())), t.sizes().vec()};
}

namespace {

Bytes encode(const std::vector<TensorSignature>& sigs) {
  Bytes out;
  wire::Writer w(out);
  w.u64(sigs.size());
  for (const auto& s : sigs) {
    w.string(s.kind);
    w.string(s.name);
    w.string(s.dtype);
    w.u64(s.shape.size());
    for (int64_t d : s.shape) w.i64(d);
  }
  return out;
}

std::vector<TensorSignature> decode(const uint8_t* data, size_t size) {
  wire::Reader r(data, size);
  // Each entry takes at least 32 bytes, so the count is bounded by the size.
  uint64_t n = r.length("signature count", size / 32);
  std::vector<TensorSignature> sigs(n);
  for (auto& s : sigs) {
    s.kind = r.string("kind", 64);
    s.name = r.string("name", size);
    s.dtype = r.string("dtype", 64);
    uint64_t dims = r.length("dims", 64);
    for (uint64_t d = 0; d < dims; ++d) s.shape.push_back(r.i64("dim"));
  }
  r.expect_end("model signature");
  return sigs;
}

}  // namespace

void verify_same_across_ranks(comm::ProcessGroup& pg, const std::vector<TensorSignature>& mine,
                              std::chrono::milliseconds timeout) {
  const int world = pg.size();
  const Bytes bytes = encode(mine);
  comm::AllgatherOptions opts;
  opts.timeout = timeout;

  at::Tensor len = at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong);
  std::vector<at::Tensor> lens;
  for (int r = 0; r < world; ++r) lens.push_back(at::empty({1}, at::kLong));
  pg.allgather(lens, len, opts)->wait();
  // The lengths come from other ranks: nothing is allocated from them before they pass a bound
  // every rank computes alike (from the shortest signature), so all ranks decide the same way.
  // Equal models have equal lengths; a signature far longer than the shortest is a different
  // model (or a forged length), reported as such instead of allocating it world-fold.
  int64_t max_len = 0, min_len = std::numeric_limits<int64_t>::max();
  int longest = 0, shortest = 0;
  for (int r = 0; r < world; ++r) {
    const int64_t n = lens[r].item<int64_t>();
    if (n < 0) TDIST_THROW(ProtocolError, "DDP: bad model signature length ", n, " from rank ", r);
    if (n > max_len) max_len = n, longest = r;
    if (n < min_len) min_len = n, shortest = r;
  }
  const int64_t bound = std::max(2 * min_len, min_len + (int64_t(1) << 20));
  if (max_len > bound) {
    TDIST_THROW(InvalidArgument,
                "DDP: the model differs across ranks (every rank must construct the same model): "
                "rank ",
                longest, "'s model signature is ", max_len, " bytes, rank ", shortest, "'s ",
                min_len);
  }

  at::Tensor mine_t = at::zeros({max_len}, at::kByte);
  std::memcpy(mine_t.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  std::vector<at::Tensor> all;
  for (int r = 0; r < world; ++r) all.push_back(at::empty({max_len}, at::kByte));
  pg.allgather(all, mine_t, opts)->wait();

  std::vector<std::vector<TensorSignature>> sigs;
  for (int r = 0; r < world; ++r) {
    int64_t n = lens[r].item<int64_t>();
    TDIST_CHECK(n >= 0 && n <= max_len, "DDP: bad model signature length from rank ", r);
    sigs.push_back(decode(all[r].data_ptr<uint8_t>(), static_cast<size_t>(n)));
  }
  // Group the ranks that differ from rank 0 by their first difference.
  std::map<std::string, std::vector<int>> differences;
  for (int r = 1; r < world; ++r) {
    const auto& a = sigs[0];
    const auto& b = sigs[r];
    size_t k = 0;
    while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
    if (k == a.size() && k == b.size()) continue;
    std::string what;
    if (k < a.size() && k < b.size()) {
      if (a[k].name == b[k].name && a[k].kind == b[k].kind) {
        what = tdist::str(a[k].kind, " ", a[k].name, " is ", a[k].dtype, " ",
                          c10::IntArrayRef(a[k].shape), " on rank 0 but ", b[k].dtype, " ",
                          c10::IntArrayRef(b[k].shape), " on rank(s) ");
      } else {
        what = tdist::str("entry ", k, " is ", a[k].describe(), " on rank 0 but ", b[k].describe(),
                          " on rank(s) ");
      }
    } else if (k < a.size()) {
      what = tdist::str(a[k].describe(), " exists on rank 0 but not on rank(s) ");
    } else {
      what = tdist::str(b[k].describe(), " is missing on rank 0 but exists on rank(s) ");
    }
    differences[what].push_back(r);
  }
  if (differences.empty()) return;
  std::ostringstream os;
  os << "DDP: the model differs across ranks (every rank must construct the same model): ";
  bool first = true;
  for (const auto& [what, ranks] : differences) {
    os << (first ? "" : "; ") << what;
    for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
    first = false;
  }
  TDIST_THROW(InvalidArgument, os.str());
}

void broadcast_coalesced(comm::ProcessGroup& pg, const std::vector<at::Tensor>& tensors, int root,
                         std::chrono::milliseconds timeout) {
  constexpr int64_t kChunkBytes = 64 << 20;
  c10::NoGradGuard no_grad;
  comm::BroadcastOptions opts;
  opts.root = root;
  opts.timeout = timeout;
  // Group by device and dtype (in first-appearance order: the same on every rank whose model
  // is laid out alike, rank r's GPU in place of rank 0's), then chunk: a flat buffer lives on
  // one device.
  std::vector<std::vector<at::Tensor>> groups;
  std::map<std::tuple<int, int, int>, size_t> group_of;
  for (const auto& t : tensors) {
    const auto key =
        std::make_tuple(static_cast<int>(t.device().type()), static_cast<int>(t.device().index()),
                        static_cast<int>(t.scalar_type()));
    auto it = group_of.find(key);
    if (it == group_of.end()) {
      it = group_of.emplace(key, groups.size()).first;
      groups.emplace_back();
    }
    groups[it->second].push_back(t);
  }
  for (const auto& group : groups) {
    size_t start = 0;
    while (start < group.size()) {
      size_t end = start;
      int64_t bytes = 0;
      std::vector<at::Tensor> flat;
      while (end < group.size() && (end == start || bytes < kChunkBytes)) {
        bytes += group[end].numel() * group[end].element_size();
        flat.push_back(group[end].detach().reshape({-1}));
        ++end;
      }
      at::Tensor buf = at::cat(flat);
      pg.broadcast(buf, opts)->wait();
      if (pg.rank() != root) {
        int64_t off = 0;
        for (size_t i = start; i < end; ++i) {
          const at::Tensor& t = group[i];
          t.detach().copy_(buf.narrow(0, off, t.numel()).view(t.sizes()));
          off += t.numel();
        }
      }
      start = end;
    }
  }
}

}  // namespace tdist::ddp
