// tdist-bench collective: times one collective over a range of buffer sizes and prints a table
// in the style of nccl-tests, checking every result, with the transport's bound per row (Note
// [Collective bounds]) and, with --anchor, the same op through Open MPI or gloo (anchors.h).
//
//   tdist-run --nproc-per-node 4 tdist-bench collective --op allreduce --min-bytes 4K
//       [--max-bytes 64M] [--iters 20] [--warmup 5] [--dtype float32] [--redop sum] [--json FILE]
//       [--anchor none|mpi|gloo] [--plot FILE.png] [--python python3]
//       [--device cpu|cuda] [--group-backend auto|ring|cpu:ring,cuda:nccl] [--symmetric]
//
// The table is printed by rank 0 once every size, the bounds and the anchor are measured.
// Sizes follow nccl-tests: "bytes" is the buffer of allreduce/broadcast/reduce, the whole
// gathered buffer of allgather/gather, the whole input of reduce_scatter/scatter and each
// rank's buffer of alltoall; allgather runs in place (the input is this rank's block of the
// output), as Open MPI's and Gloo's anchors do. Time per iteration is the slowest rank's (max
// over ranks of the iteration's time), the row shows the median over iterations. busbw = algbw
// times 2(n-1)/n (allreduce), (n-1)/n (allgather, reduce_scatter, alltoall, gather, scatter),
// 1 (broadcast, reduce). --backend gloo is not available from C++ here (libtorch's Gloo headers
// are not installed with the wheel): --anchor gloo (and scripts/bench_gloo.py, every op and
// world size in rounds) runs torch.distributed's Gloo in the same run.
//
// --device cuda puts the buffers on GPU LOCAL_RANK (apps/common/device.h; ranks share the GPUs,
// LOCAL_RANK modulo their count, where --group-backend stages CUDA tensors through the ring) and
// each timed iteration ends with torch::cuda::synchronize(), so its time includes the GPU's work
// (a backend's copies through host memory, NCCL's kernels). The anchors run on CPU tensors only,
// so --anchor refuses --device cuda (scripts/bench_gloo.py --device cuda times torch.distributed's
// NCCL or Gloo on CUDA tensors instead); the bound stays the host transport's (Note [Collective
// bounds]).
//
// --symmetric allocates the buffer of an allreduce or a broadcast, an allgather's output or a
// reduce_scatter's input with ProcessGroup::symmetric_empty (Note [Symmetric memory] in
// comm/ring/symmetric_memory.cpp), as NCCL's tests register theirs; other operations ignore it.

#include "apps/bench/subcommands.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "apps/bench/anchors.h"
#include "apps/bench/check.h"
#include "apps/common/device.h"
#include "apps/bench/bounds.h"
#include "apps/bench/common.h"
#include "tdist/comm/process_group.h"
#include "tdist/comm/transport/channels.h"
#include "tdist/core/net/address.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/rendezvous.h"

namespace tdist::bench {
// Named as well as anonymous: tdist-bench is a unity build, and the subcommands' helpers
// (each has its own Config, worker_main, ...) must not meet.
namespace collective_bench {
namespace {

using comm::ProcessGroup;
using comm::ReduceOp;

struct Config {
  std::string op = "allreduce";
  std::string min_bytes = "4K";
  std::string max_bytes = "64M";
  double step_factor = 2;
  int iters = 20;
  int warmup = 5;
  std::string dtype = "float32";
  std::string redop = "sum";
  std::string backend = "tdist";
  std::string json;
  std::string init_method = "env://";
  int root = 0;
  std::string anchor = "none";
  std::string python = "python3";
  std::string plot;
  std::string device = "cpu";
  std::string group_backend = "auto";
  bool symmetric = false;
};

struct Row {
  size_t bytes;
  int64_t count;
  double time_us;
  double algbw;
  double busbw;
  int64_t wrong;
  double bound = 0;         // GB/s of the transport's bound (Note [Collective bounds])
  double of_bound = 0;      // busbw / bound
  double xcore = 0;         // GB/s of a cross-core copy (Note [Cross-core copy]); 0: not measured
  double of_xcore = 0;      // busbw / xcore
  double anchor_us = 0;     // --anchor's time
  double anchor_busbw = 0;  // and busbw
  double of_anchor = 0;     // busbw / the anchor's busbw
};

// --symmetric: the operations whose buffer (allgather: output, reduce_scatter: input) it puts in
// symmetric memory.
bool takes_symmetric(const Config& cfg) {
  return cfg.symmetric && (cfg.op == "allreduce" || cfg.op == "broadcast" ||
                           cfg.op == "allgather" || cfg.op == "reduce_scatter");
}

at::ScalarType parse_dtype(const std::string& s) {
  static const std::map<std::string, at::ScalarType> m = {
      {"float32", at::kFloat}, {"float", at::kFloat},       {"float64", at::kDouble},
      {"float16", at::kHalf},  {"bfloat16", at::kBFloat16}, {"int32", at::kInt},
      {"int64", at::kLong},    {"int8", at::kChar},         {"uint8", at::kByte}};
  auto it = m.find(s);
  TDIST_CHECK_ARG(it != m.end(), "unknown dtype '", s,
                  "' (float32, float64, float16, bfloat16, int32, int64, int8, uint8)");
  return it->second;
}

ReduceOp parse_redop(const std::string& s) {
  static const std::map<std::string, ReduceOp> m = {{"sum", ReduceOp::SUM},
                                                    {"avg", ReduceOp::AVG},
                                                    {"prod", ReduceOp::PRODUCT},
                                                    {"min", ReduceOp::MIN},
                                                    {"max", ReduceOp::MAX}};
  auto it = m.find(s);
  TDIST_CHECK_ARG(it != m.end(), "unknown redop '", s, "' (sum, avg, prod, min, max)");
  return it->second;
}

double bus_factor(const std::string& op, int n) {
  if (op == "allreduce") return 2.0 * (n - 1) / n;
  if (op == "broadcast" || op == "reduce") return 1.0;
  return static_cast<double>(n - 1) / n;
}

// One size of one collective: buffers, the operation, and the check of its result.
class Case {
 public:
  Case(ProcessGroup& pg, const Config& cfg, at::ScalarType dtype, ReduceOp redop, int64_t count,
       c10::Device device)
      : pg_(pg),
        cfg_(cfg),
        dtype_(dtype),
        redop_(redop),
        n_(pg.size()),
        r_(pg.rank()),
        count_(count),
        device_(device) {
    const auto& op = cfg.op;
    static const std::map<std::string, Kind> kinds = {{"allreduce", Kind::kAllreduce},
                                                      {"broadcast", Kind::kBroadcast},
                                                      {"reduce", Kind::kReduce},
                                                      {"allgather", Kind::kAllgather},
                                                      {"gather", Kind::kGather},
                                                      {"scatter", Kind::kScatter},
                                                      {"reduce_scatter", Kind::kReduceScatter},
                                                      {"alltoall", Kind::kAlltoall},
                                                      {"barrier", Kind::kBarrier}};
    const auto kind = kinds.find(op);
    if (kind == kinds.end()) {
      TDIST_THROW(InvalidArgument, "unknown --op '", op,
                  "' (allreduce, broadcast, reduce, allgather, gather, scatter, reduce_scatter, "
                  "alltoall, barrier)");
    }
    kind_ = kind->second;
    auto opts = at::TensorOptions().dtype(dtype).device(device);
    int64_t block = count / n_;
    switch (kind_) {
      case Kind::kAllreduce:
      case Kind::kBroadcast:
      case Kind::kReduce:
        a_ = takes_symmetric(cfg) ? pg.symmetric_empty({count}, dtype) : at::empty({count}, opts);
        break;
      case Kind::kAllgather:
        // In place, as the Open MPI anchor (MPI_IN_PLACE): the input is this rank's block of the
        // output.
        b_ = takes_symmetric(cfg) ? pg.symmetric_empty({block * n_}, dtype)
                                  : at::empty({block * n_}, opts);
        a_ = b_.narrow(0, r_ * block, block);
        break;
      case Kind::kGather:
        a_ = at::empty({block}, opts);
        b_ = at::empty({block * n_}, opts);
        break;
      case Kind::kReduceScatter:
      case Kind::kScatter:
        a_ = takes_symmetric(cfg) ? pg.symmetric_empty({block * n_}, dtype)
                                  : at::empty({block * n_}, opts);
        b_ = at::empty({block}, opts);
        break;
      case Kind::kAlltoall:
        a_ = at::empty({block * n_}, opts);
        b_ = at::empty({block * n_}, opts);
        break;
      case Kind::kBarrier:
        break;
    }
    fill();
  }

  // This rank's input (check.h): position- and rank-dependent small integers.
  void fill() {
    if (!a_.defined()) return;
    if (b_.defined()) b_.zero_();  // first: an allgather's input is part of it
    a_.copy_(input_values(r_, a_.numel()).to(dtype_));
  }

  void run() {
    std::shared_ptr<comm::Work> w;
    switch (kind_) {
      case Kind::kAllreduce: {
        comm::AllreduceOptions o;
        o.op = redop_;
        w = pg_.allreduce(a_, o);
        break;
      }
      case Kind::kBroadcast: {
        comm::BroadcastOptions o;
        o.root = cfg_.root;
        w = pg_.broadcast(a_, o);
        break;
      }
      case Kind::kReduce: {
        comm::ReduceOptions o;
        o.root = cfg_.root;
        o.op = redop_;
        w = pg_.reduce(a_, o);
        break;
      }
      case Kind::kAllgather:
        w = pg_.allgather_into_tensor(b_, a_);
        break;
      case Kind::kGather: {
        comm::GatherOptions o;
        o.root = cfg_.root;
        std::vector<at::Tensor> outs;
        if (r_ == cfg_.root) outs = b_.chunk(n_);
        w = pg_.gather(outs, a_, o);
        break;
      }
      case Kind::kScatter: {
        comm::ScatterOptions o;
        o.root = cfg_.root;
        std::vector<at::Tensor> ins;
        if (r_ == cfg_.root) ins = a_.chunk(n_);
        w = pg_.scatter(b_, ins, o);
        break;
      }
      case Kind::kReduceScatter: {
        comm::ReduceScatterOptions o;
        o.op = redop_;
        w = pg_.reduce_scatter_tensor(b_, a_, o);
        break;
      }
      case Kind::kAlltoall:
        w = pg_.alltoall_base(b_, a_, {}, {});
        break;
      case Kind::kBarrier:
        w = pg_.barrier();
        break;
    }
    w->wait();
    // A GPU's work may still be queued after wait() (stream semantics): the time includes it.
    if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
  }

  // Elements of this rank's output that differ from the expected result (check.h).
  int64_t wrong() const {
    const auto& op = cfg_.op;
    const bool in_a = op == "allreduce" || op == "broadcast" || op == "reduce";
    return count_wrong(in_a ? a_ : b_,
                       expected_output(op, redop_, dtype_, r_, n_, cfg_.root, count_));
  }

 private:
  ProcessGroup& pg_;
  const Config& cfg_;
  at::ScalarType dtype_;
  ReduceOp redop_;
  int n_, r_;
  int64_t count_;
  c10::Device device_;
  // cfg_.op, parsed once: string compares in run() would be timed as the operation's.
  enum class Kind {
    kAllreduce,
    kBroadcast,
    kReduce,
    kAllgather,
    kGather,
    kScatter,
    kReduceScatter,
    kAlltoall,
    kBarrier
  };
  Kind kind_ = Kind::kBarrier;
  at::Tensor a_, b_;
};

// What rank 0 measures after the tdist rows, while the other ranks wait in the store: the bound of
// the transport the group used (Note [Collective bounds]) and, with --anchor, the same op through
// another library. Every rank calls it; rows are filled on rank 0.
//
// Note [Collective bounds]
//   Hosts are told apart by the host key the process group uses (comm/transport/channels.h:
//   boot id and network namespace, or TDIST_HOST_ID). Shared memory (every rank on one host,
//   TDIST_TRANSPORT not "tcp"): the bandwidth of one thread's memcpy of the row's size on rank 0
//   (a ring step moves each byte at least once through memory; busbw counts each byte once).
//   TCP: a plain TCP stream of the row's size from rank 0 to the first rank on another host
//   (rank 1 over 127.0.0.1 when every rank is on one host), each transfer acknowledged by one
//   byte. With H hosts of several ranks each, the link is what bounds: each host must send at
//   least (H-1)/H of the data through it (allreduce twice that), while busbw counts (n-1)/n (twice
//   that), so the bound is the stream's bandwidth times (n-1)/n * H/(H-1) for allreduce, allgather
//   and reduce_scatter; other ops keep the stream's. Both: --warmup untimed, --iters timed, the
//   median. Shared memory adds a second bound per row, the cross-core copy (xcore: Note
//   [Cross-core copy] in bounds.h), which a buffer that fits one core's caches cannot copy at
//   the memcpy bound's rate.
void measure_bounds_and_anchor(const Config& cfg, Store& store, int rank, int n,
                               std::vector<Row>& rows, std::string* bound_name,
                               std::optional<CoreRoundTrip>* round_trip) {
  const std::string prefix = "tdist-bench/collective/";
  store.set(prefix + "host/" + std::to_string(rank), comm::host_key());
  if (rank == 0) {
    std::vector<std::string> hosts{comm::host_key()};
    for (int r = 1; r < n; ++r)
      hosts.push_back(store.get_string(prefix + "host/" + std::to_string(r)));
    // The lowest rank on another host, else rank 1.
    const auto other = std::find_if(hosts.begin() + 1, hosts.end(),
                                    [&](const std::string& h) { return h != hosts[0]; });
    const int peer =
        other != hosts.end() ? static_cast<int>(other - hosts.begin()) : (n >= 2 ? 1 : -1);
    std::vector<std::string> distinct = hosts;
    std::sort(distinct.begin(), distinct.end());
    const int num_hosts =
        static_cast<int>(std::unique(distinct.begin(), distinct.end()) - distinct.begin());
    const bool one_host = num_hosts == 1;
    const char* transport = std::getenv("TDIST_TRANSPORT");
    const bool tcp = n >= 2 && (!one_host || (transport && std::string(transport) == "tcp"));
    // The peer listens on loopback when every rank is on this host, else on the address it
    // publishes; never on every interface.
    store.set(prefix + "bound-loopback", one_host ? "1" : "0");
    store.set(prefix + "bound-peer", std::to_string(tcp ? peer : -1));
    if (tcp) {
      const std::string addr = store.get_string(prefix + "tcp-peer");
      const auto colon = addr.rfind(':');
      TcpLink link = TcpLink::connect(addr.substr(0, colon), std::stoi(addr.substr(colon + 1)),
                                      store.get_string(prefix + "tcp-key"));
      const bool shared_link =
          num_hosts >= 2 && num_hosts < n &&
          (cfg.op == "allreduce" || cfg.op == "allgather" || cfg.op == "reduce_scatter");
      const double factor = shared_link ? (n - 1.0) / n * num_hosts / (num_hosts - 1.0) : 1.0;
      for (auto& row : rows) {
        const double s =
            median(time_tcp(link, TcpPattern::kStream, row.bytes, cfg.warmup, cfg.iters));
        row.bound = row.bytes / s / 1e9 * factor;
      }
      *bound_name =
          str("plain TCP stream rank 0 -> rank ", peer, one_host ? " (127.0.0.1)" : "",
              shared_link ? str(" x ", factor, " (", num_hosts, " hosts share their links)") : "");
    } else {
      // At most 1000 samples: a sample copies at least 256 KiB (bounds.h), and --iters may be
      // in the millions for small sizes.
      const int samples = std::min(cfg.iters, 1000);
      for (auto& row : rows) {
        row.bound = row.bytes / median(time_memcpy(row.bytes, cfg.warmup, samples)) / 1e9;
        // Note [Cross-core copy]: fewer samples of the large sizes (each writes and copies two
        // buffers of the row's size).
        const int cross_samples = std::max(
            10, std::min({cfg.iters, 200,
                          static_cast<int>((size_t{512} << 20) / std::max<size_t>(row.bytes, 1))}));
        if (auto cross = time_cross_core_copy(row.bytes, cross_samples)) {
          row.xcore = row.bytes / median(*cross) / 1e9;
          row.of_xcore = row.busbw / row.xcore;
        }
      }
      *bound_name = "single-thread memcpy";
    }
    for (auto& row : rows) row.of_bound = row.busbw / row.bound;
    if (cfg.anchor != "none") {
      AnchorRun run{cfg.anchor,    cfg.op,          n,  cfg.warmup, cfg.iters, cfg.min_bytes,
                    cfg.max_bytes, cfg.step_factor, {}, cfg.python};
      for (const auto& row : rows) run.bytes.push_back(row.bytes);
      const std::vector<double> times = run_anchor(run);
      for (size_t i = 0; i < rows.size(); ++i) {
        rows[i].anchor_us = times[i];
        rows[i].anchor_busbw = rows[i].bytes / times[i] / 1e3 * bus_factor(cfg.op, n);
        rows[i].of_anchor = times[i] / rows[i].time_us;  // = busbw / anchor's busbw
      }
    }
    *round_trip = core_round_trip();  // Note [Core-to-core round trip]: after the rows
    store.set(prefix + "done", "1");
  } else {
    if (std::stoi(store.get_string(prefix + "bound-peer")) == rank) {
      const std::string host = store.get_string(prefix + "bound-loopback") == "1"
                                   ? "127.0.0.1"
                                   : net::local_address(store.server_host());
      TcpListener listener(host);
      store.set(prefix + "tcp-key", listener.key());  // before the address the peer waits for
      store.set(prefix + "tcp-peer", host + ":" + std::to_string(listener.port()));
      TcpLink link = listener.accept();
      serve_tcp_bounds(link, std::max<size_t>(parse_bytes(cfg.max_bytes), 1));
    }
    store.wait({prefix + "done"}, Millis(2 * 3600 * 1000));
  }
}

void print_rows(const Config& cfg, int n, const std::vector<Row>& rows,
                const std::string& bound_name, const RoundTrips& trips) {
  const bool per_rank_blocks = cfg.op != "allreduce" && cfg.op != "broadcast" && cfg.op != "reduce";
  const bool anchor = cfg.anchor != "none";
  std::printf(
      "# tdist-bench collective: op %s, backend %s (%s), device %s, world size %d, "
      "dtype %s, redop %s, iters %d, warmup %d%s\n",
      cfg.op.c_str(), cfg.backend.c_str(), cfg.group_backend.c_str(), cfg.device.c_str(), n,
      cfg.dtype.c_str(), cfg.redop.c_str(), cfg.iters, cfg.warmup,
      takes_symmetric(cfg) ? ", buffers in symmetric memory" : "");
  std::printf(
      "# bound: %s of the row's size, measured in this run%s\n", bound_name.c_str(),
      anchor ? ("; anchor: " +
                std::string(cfg.anchor == "mpi" ? "Open MPI (mpirun)" : "torch.distributed gloo") +
                ", same op and sizes, float32 sum, median of --iters")
                   .c_str()
             : "");
  // Rank 0 measured it before and after the rows (Note [Core-to-core round trip] in bounds.h).
  std::printf("# %s\n", trips.describe("the rows").c_str());
  const bool xcore = !rows.empty() && rows.front().xcore > 0;
  if (xcore) {
    std::printf(
        "# xcore: a core's memcpy of a buffer another core just wrote, both cores at once "
        "(the round trip's two CPUs; Note [Cross-core copy] in apps/bench/bounds.h)\n");
  }
  std::printf("#%12s %12s %9s %7s %12s %11s %11s %11s %9s", "size(B)", "count", "type", "redop",
              "time(us)", "algbw(GB/s)", "busbw(GB/s)", "bound(GB/s)", "bus/bound");
  if (xcore) std::printf(" %11s %9s", "xcore(GB/s)", "bus/xcore");
  if (anchor)
    std::printf(" %12s %11s %9s", (cfg.anchor + "(us)").c_str(), (cfg.anchor + "_busbw").c_str(),
                ("bus/" + cfg.anchor).c_str());
  std::printf(" %8s\n", "#wrong");
  for (const auto& row : rows) {
    std::printf(" %12zu %12lld %9s %7s %12.2f %11.3f %11.3f %11.3f %9.3g", row.bytes,
                static_cast<long long>(row.count), cfg.dtype.c_str(),
                per_rank_blocks && cfg.op != "reduce_scatter" ? "none" : cfg.redop.c_str(),
                row.time_us, row.algbw, row.busbw, row.bound, row.of_bound);
    if (xcore) std::printf(" %11.3f %9.3g", row.xcore, row.of_xcore);
    if (anchor) std::printf(" %12.2f %11.3f %9.3g", row.anchor_us, row.anchor_busbw, row.of_anchor);
    std::printf(" %8lld\n", static_cast<long long>(row.wrong));
  }
  std::fflush(stdout);
}

void write_json(const Config& cfg, int n, const std::vector<Row>& rows,
                const std::string& bound_name, const RoundTrips& trips, const std::string& path) {
  nlohmann::json j{{"op", cfg.op},         {"backend", cfg.backend},
                   {"world_size", n},      {"dtype", cfg.dtype},
                   {"bound", bound_name},  {"anchor", cfg.anchor},
                   {"device", cfg.device}, {"group_backend", cfg.group_backend}};
  j["core_round_trip"] = trips.json();
  j["rows"] = nlohmann::json::array();
  for (const auto& r : rows) {
    nlohmann::json row{{"bytes", r.bytes},     {"time_us", r.time_us},
                       {"algbw_gbs", r.algbw}, {"busbw_gbs", r.busbw},
                       {"bound_gbs", r.bound}, {"busbw_over_bound", r.of_bound},
                       {"wrong", r.wrong}};
    if (r.xcore > 0) {
      row["xcore_gbs"] = r.xcore;
      row["busbw_over_xcore"] = r.of_xcore;
    }
    if (cfg.anchor != "none") {
      row["anchor_time_us"] = r.anchor_us;
      row["anchor_busbw_gbs"] = r.anchor_busbw;
      row["busbw_over_anchor"] = r.of_anchor;
    }
    j["rows"].push_back(row);
  }
  std::ofstream out(path);
  TDIST_CHECK(out.good(), "cannot write ", path);
  out << j.dump(1) << "\n";
}

int run_collective(const Config& cfg) {
  TDIST_CHECK_ARG(cfg.backend == "tdist",
                  "--backend gloo: libtorch's ProcessGroupGloo cannot be driven from C++ with the "
                  "pip wheel (it ships no gloo headers); use --anchor gloo, which runs "
                  "torch.distributed's Gloo in the same run and prints the ratios");
  TDIST_CHECK_ARG(cfg.iters >= 1 && cfg.warmup >= 0, "--iters must be >= 1 and --warmup >= 0");
  TDIST_CHECK_ARG(cfg.step_factor > 1, "--step-factor must be > 1");
  const size_t min_b = parse_bytes(cfg.min_bytes);
  const size_t max_b = parse_bytes(cfg.max_bytes);
  TDIST_CHECK_ARG(min_b <= max_b, "--min-bytes is larger than --max-bytes");
  const auto dtype = parse_dtype(cfg.dtype);
  const auto redop = parse_redop(cfg.redop);
  TDIST_CHECK_ARG(cfg.device == "cpu" || cfg.anchor == "none", "--anchor ", cfg.anchor,
                  " times CPU tensors only and cannot run with --device ", cfg.device,
                  ": drop --anchor, or use --device cpu");
  check_anchor(cfg.anchor, cfg.dtype, cfg.redop);
  // Before anything else asks libtorch about CUDA (apps/common/device.h).
  // Ranks share the GPUs where CUDA tensors go through the ring (staged through host memory).
  const bool staged =
      cfg.group_backend == "ring" || cfg.group_backend.find("cuda:ring") != std::string::npos;
  const c10::Device device = apps::resolve_device("--device", cfg.device, staged);
  at::set_num_threads(1);

  ProcessGroup::Options opts;
  opts.timeout = Millis(300000);
  opts.backend = cfg.group_backend;
  auto rdzv = rendezvous(cfg.init_method, -1, -1, opts.timeout);
  auto pg = comm::create_process_group(rdzv.store, rdzv.rank, rdzv.world_size, opts);
  set_log_rank(pg->rank());
  const int n = pg->size();
  const bool print = pg->rank() == 0;
  const size_t esize = at::elementSize(dtype);
  const bool per_rank_blocks = cfg.op != "allreduce" && cfg.op != "broadcast" && cfg.op != "reduce";
  // Note [Core-to-core round trip]: rank 0 measures while the others wait in the store.
  RoundTrips trips;
  if (pg->rank() == 0) {
    trips.before = core_round_trip();
    rdzv.store->set("tdist-bench/collective/round-trip", "1");
  } else {
    rdzv.store->wait({"tdist-bench/collective/round-trip"}, opts.timeout);
  }
  std::vector<Row> rows;
  std::vector<size_t> sizes;
  for (double b = static_cast<double>(min_b); b <= static_cast<double>(max_b) * 1.0000001;
       b *= cfg.step_factor) {
    sizes.push_back(static_cast<size_t>(b));
    if (cfg.op == "barrier") break;
  }
  for (size_t bytes : sizes) {
    int64_t count = static_cast<int64_t>(bytes / esize);
    if (per_rank_blocks) count = count / n * n;
    const size_t real_bytes = static_cast<size_t>(count) * esize;
    Case c(*pg, cfg, dtype, redop, count, device);
    for (int i = 0; i < cfg.warmup; ++i) c.run();
    auto times = at::empty({cfg.iters}, at::kDouble);
    auto* t = times.data_ptr<double>();
    for (int i = 0; i < cfg.iters; ++i) {
      auto start = std::chrono::steady_clock::now();
      c.run();
      t[i] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
                 .count();
    }
    comm::AllreduceOptions max;
    max.op = ReduceOp::MAX;
    pg->allreduce(times, max)->wait();  // each iteration's slowest rank
    double median = std::get<0>(at::median(times, 0)).item<double>();
    c.fill();
    c.run();
    auto wrong = at::full({1}, c.wrong(), at::kLong);
    pg->allreduce(wrong)->wait();
    Row row{real_bytes, count, median, 0, 0, wrong.item<int64_t>()};
    row.algbw = median > 0 ? real_bytes / median / 1e3 : 0;
    row.busbw = row.algbw * bus_factor(cfg.op, n);
    rows.push_back(row);
    if (print) std::fprintf(stderr, "tdist-bench collective: %zu bytes done\n", real_bytes);
  }
  pg->barrier()->wait();
  std::string bound_name;
  measure_bounds_and_anchor(cfg, *rdzv.store, pg->rank(), n, rows, &bound_name, &trips.after);
  int64_t total_wrong = 0;
  for (const auto& r : rows) total_wrong += r.wrong;
  if (print) {
    print_rows(cfg, n, rows, bound_name, trips);
    std::string json = cfg.json;
    if (json.empty() && !cfg.plot.empty()) json = cfg.plot + ".json";
    if (!json.empty()) write_json(cfg, n, rows, bound_name, trips, json);
    if (!cfg.plot.empty()) draw_plot(cfg.python, "collective", json, cfg.plot);
  }
  pg->barrier()->wait();
  if (print && total_wrong > 0)
    std::fprintf(stderr, "tdist-bench: %lld wrong elements\n", static_cast<long long>(total_wrong));
  return total_wrong > 0 ? 3 : 0;
}

}  // namespace
}  // namespace collective_bench

void add_collective_command(CLI::App& app) {
  using namespace collective_bench;
  auto cfg = std::make_shared<Config>();
  auto* sub = app.add_subcommand("collective",
                                 "time one collective over a range of sizes (nccl-tests style)");
  sub->add_option("--op", cfg->op,
                  "allreduce, broadcast, reduce, allgather, gather, scatter, reduce_scatter, "
                  "alltoall, barrier")
      ->capture_default_str();
  sub->add_option("--min-bytes,-b", cfg->min_bytes, "smallest size (K/M/G suffixes)")
      ->capture_default_str();
  sub->add_option("--max-bytes,-e", cfg->max_bytes, "largest size")->capture_default_str();
  sub->add_option("--step-factor,-f", cfg->step_factor, "size multiplier between rows")
      ->capture_default_str();
  sub->add_option("--iters,-n", cfg->iters, "timed iterations per size")->capture_default_str();
  sub->add_option("--warmup,-w", cfg->warmup, "untimed iterations per size")->capture_default_str();
  sub->add_option("--dtype,-d", cfg->dtype, "element type")->capture_default_str();
  sub->add_option("--redop,-o", cfg->redop, "sum, avg, prod, min, max")->capture_default_str();
  sub->add_option("--root,-r", cfg->root, "root of broadcast/reduce/gather/scatter")
      ->capture_default_str();
  sub->add_option("--backend", cfg->backend, "tdist (gloo: see --anchor gloo)")
      ->capture_default_str();
  sub->add_option("--json", cfg->json, "also write the rows as JSON to this file (rank 0)");
  sub->add_option("--init-method", cfg->init_method, "rendezvous URL")->capture_default_str();
  sub->add_option("--anchor", cfg->anchor,
                  "also run the same op and sizes through Open MPI (mpirun) or torch.distributed's "
                  "gloo on this host and print the ratio per row")
      ->check(CLI::IsMember({"none", "mpi", "gloo"}))
      ->capture_default_str();
  sub->add_option("--python", cfg->python, "Python with torch and matplotlib (gloo anchor, --plot)")
      ->capture_default_str();
  sub->add_option("--device", cfg->device,
                  "where the buffers live: cpu, or cuda (GPU LOCAL_RANK, or LOCAL_RANK modulo the "
                  "GPUs when --group-backend stages CUDA tensors through the ring; times include "
                  "the GPU's work; no --anchor)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  sub->add_option("--group-backend", cfg->group_backend,
                  "the process group's backend: auto (NCCL for CUDA tensors where a GPU is "
                  "visible, else ring), ring, or one per device type, e.g. cpu:ring,cuda:nccl "
                  "(docs/comm.md)")
      ->capture_default_str();
  sub->add_option("--plot", cfg->plot,
                  "draw busbw against the bound and the anchor to this PNG (rank 0; the JSON "
                  "goes to --json, else FILE.json)");
  sub->add_flag("--symmetric", cfg->symmetric,
                "allreduce, broadcast: the buffer, allgather: the output, reduce_scatter: the "
                "input, in symmetric memory (ProcessGroup::symmetric_empty), read by the peers "
                "where it lies");
  sub->callback([cfg] {
    int rc = run_collective(*cfg);
    if (rc != 0) std::exit(rc);
  });
}

}  // namespace tdist::bench
