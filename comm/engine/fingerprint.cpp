#include "tdist/comm/engine/fingerprint.h"

#include <c10/core/ScalarType.h>

#include "tdist/comm/types.h"
#include "tdist/core/error.h"
#include "tdist/core/wire.h"

namespace tdist::comm::detail {
namespace {

constexpr uint64_t kMaxFingerprintBytes = 1 << 20;
constexpr uint64_t kMaxShapes = 1 << 16;
constexpr uint64_t kMaxDims = 64;

std::string shapes_text(const std::vector<std::vector<int64_t>>& shapes) {
  std::string s = "[";
  for (size_t i = 0; i < shapes.size(); ++i) {
    if (i) s += ", ";
    s += "[";
    for (size_t j = 0; j < shapes[i].size(); ++j) s += str(j ? ", " : "", shapes[i][j]);
    s += "]";
  }
  return s + "]";
}

std::string dtype_text(int32_t d) {
  if (d < 0) return "none";
  return c10::toString(static_cast<c10::ScalarType>(d));
}

std::string redop_text(int32_t r) { return r < 0 ? "none" : to_string(static_cast<ReduceOp>(r)); }

}  // namespace

Bytes Fingerprint::encode() const {
  Bytes out;
  wire::Writer w(out);
  w.string(op);
  w.u64(seq);
  w.pod(dtype);
  w.pod(redop);
  w.pod(root);
  w.u64(shapes.size());
  for (const auto& s : shapes) {
    w.u64(s.size());
    for (int64_t d : s) w.i64(d);
  }
  return out;
}

Fingerprint Fingerprint::decode(const Bytes& bytes) {
  wire::Reader r(bytes);
  Fingerprint f;
  f.op = r.string("op", 256);
  f.seq = r.u64("seq");
  f.dtype = r.pod<int32_t>("dtype");
  f.redop = r.pod<int32_t>("redop");
  f.root = r.pod<int32_t>("root");
  uint64_t n = r.length("shape count", kMaxShapes);
  f.shapes.resize(n);
  for (auto& s : f.shapes) {
    uint64_t dims = r.length("dims", kMaxDims);
    s.resize(dims);
    for (auto& d : s) d = r.i64("dim");
  }
  r.expect_end("fingerprint");
  return f;
}

std::string Fingerprint::difference(const Fingerprint& o) const {
  std::string d;
  auto add = [&](const std::string& field, const std::string& a, const std::string& b) {
    if (a != b) d += str(d.empty() ? "" : ", ", field, " ", a, " vs ", b);
  };
  add("op", op, o.op);
  add("sequence number", std::to_string(seq), std::to_string(o.seq));
  add("dtype", dtype_text(dtype), dtype_text(o.dtype));
  add("reduce op", redop_text(redop), redop_text(o.redop));
  add("root", std::to_string(root), std::to_string(o.root));
  add("shapes", shapes_text(shapes), shapes_text(o.shapes));
  return d;
}

void check_fingerprints(Exchange& ex, const Fingerprint& mine) {
  const int n = ex.size();
  const int r = ex.rank();
  if (n == 1) return;
  Bytes encoded = mine.encode();
  uint64_t len = encoded.size();
  std::vector<uint64_t> lens(n, 0);
  std::vector<Bytes> theirs(n);
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    ex.send(p, &len, sizeof(len));
    ex.send(p, encoded.data(), encoded.size());
    ex.recv(p, &lens[p], sizeof(uint64_t), 1);
  }
  ex.run([&](int p, uint64_t cookie) {
    if (cookie != 1) return;
    if (lens[p] > kMaxFingerprintBytes) {
      TDIST_THROW(ProtocolError, ex.where(), ": rank ", p, " sent a fingerprint of ", lens[p],
                  " bytes (more than ", kMaxFingerprintBytes, ")");
    }
    theirs[p].resize(lens[p]);
    ex.recv(p, theirs[p].data(), lens[p], 2);
  });
  std::vector<Fingerprint> all(n);
  for (int p = 0; p < n; ++p) all[p] = p == r ? mine : Fingerprint::decode(theirs[p]);
  std::string diffs;
  for (int p = 1; p < n; ++p) {
    std::string d = all[0].difference(all[p]);
    if (!d.empty())
      diffs += str(diffs.empty() ? "" : "; ", "rank ", p, " differs from rank 0: ", d);
  }
  if (!diffs.empty()) {
    TDIST_THROW(MismatchError, ex.where(),
                ": the ranks called different collectives (TDIST_DEBUG=DETAIL): ", diffs);
  }
}

}  // namespace tdist::comm::detail
