#include "tdist/comm/ring/ring_process_group.h"
#include "tdist/comm/ring/ring_tuning.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <set>

#include "tdist/comm/algorithms/allgather_ring.h"
#include "tdist/comm/algorithms/single_copy.h"
#include "tdist/comm/ring/staged_message.h"
#include "tdist/comm/ring/staging.h"
#include "tdist/comm/transport/shm/shm_channel.h"
#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/prefix_store.h"
#include "tdist/core/tensor_wire.h"
#include "tdist/core/token.h"

namespace tdist::comm::detail {
namespace {

// Work of recv_any_source: remembers where the message came from.
class RecvWork : public Work {
 public:
  using Work::Work;
  int source_rank() const override { return source_.load(); }
  std::atomic<int> source_{-1};
};

Clock::time_point deadline_after(Millis timeout, Clock::time_point now = Clock::now()) {
  if (timeout > std::chrono::duration_cast<Millis>(Clock::time_point::max() - now)) {
    return Clock::time_point::max();
  }
  return now + timeout;
}

// Note [Spin, then sleep]
// A peer on this host usually answers within microseconds, and a futex sleep plus wake-up costs
// several of them; so a rank with shared-memory peers spins (re-trying its transfers, yielding
// the core between tries) for kSpinUs before it sleeps. Each try yields, so on a host with more
// ranks than cores the spinner hands its core to a peer that has work; and a spin that runs out
// makes the next waits skip theirs, more of them each time (Exchange::run_impl), so ranks that
// wait for slow peers (large transfers, DDP waiting on computation) soon stop spinning. Measured
// in docs/perf-history.md ("Waking a rank", "RPC waits spin first"): at world 4 on 2 cores,
// spinning halves a 4 KiB allreduce and changes neither larger ones nor DDP's throughput.
// TDIST_SPIN_US overrides (0: never spin).
// A yield is a system call, and it is most of what a rank waiting on an idle peer pays per try:
// when every rank of this host can have a core of its own (no more ranks on the host than CPUs
// this process may run on), the first kBusyPollNs of each spin re-try with only a CPU pause
// between tries (no core is wanted by anyone else then), which halved a 4 KiB allreduce and a
// barrier at world 2 on 2 cores. With more ranks than cores it would keep a peer that has work
// off the core, which made world 4 on 2 cores slower, so there every try yields as before. The
// scheduler may still put two ranks on one core (seen about once in 15 runs at world 2 on 2
// cores); a busy poll that runs out therefore makes the next 1, 3, 7 ... 63 spins yield from
// their start, like the spin's own back-off, and such a run costs what yielding alone costs.
// TDIST_BUSY_POLL_NS overrides (0: always yield).
constexpr int kSpinUs = 50;
constexpr int kBusyPollNs = 2000;

int default_spin_us(const std::vector<std::unique_ptr<Channel>>& channels) {
  for (const auto& c : channels) {
    if (c && std::string(c->kind()) == "shm") return kSpinUs;
  }
  return 0;
}

// kBusyPollNs when this host's ranks (those with this rank's host key) fit on the CPUs this
// process may run on, else 0 (Note [Spin, then sleep]).
int default_busy_poll_ns(const std::vector<std::string>& hosts, int rank) {
  const auto local = std::count(hosts.begin(), hosts.end(), hosts[rank]);
  return static_cast<size_t>(local) <= env::allowed_cpus().size() ? kBusyPollNs : 0;
}

// The hosts of the group from every rank's host key, when each has the same number of ranks (at
// least two) and there are at least two of them. Hosts are ordered by their lowest rank, so
// every rank derives the same hierarchy.
std::optional<algorithms::Hierarchy> find_hierarchy(const std::vector<std::string>& hosts,
                                                    int rank) {
  std::vector<std::vector<int>> groups;
  std::vector<const std::string*> keys;
  for (int r = 0; r < static_cast<int>(hosts.size()); ++r) {
    size_t g = 0;
    while (g < keys.size() && *keys[g] != hosts[r]) ++g;
    if (g == keys.size()) {
      keys.push_back(&hosts[r]);
      groups.emplace_back();
    }
    groups[g].push_back(r);
  }
  const size_t per_host = groups[0].size();
  if (groups.size() < 2 || per_host < 2) return std::nullopt;
  for (const auto& g : groups) {
    if (g.size() != per_host) return std::nullopt;
  }
  algorithms::Hierarchy h;
  for (int g = 0; g < static_cast<int>(groups.size()); ++g) {
    auto it = std::find(groups[g].begin(), groups[g].end(), rank);
    if (it == groups[g].end()) continue;
    h.local = groups[g];
    h.host_index = g;
    h.local_index = static_cast<int>(it - groups[g].begin());
  }
  for (const auto& g : groups) h.cross.push_back(g[static_cast<size_t>(h.local_index)]);
  return h;
}

// Values the group must agree on before any operation: every rank sends its own to every peer,
// and all take the largest of each. The single-copy threshold (Note [Single-copy collectives]
// in algorithms/single_copy.h; kNoSingleCopy from a rank that may not or cannot read every peer),
// the allgather's choice (AllgatherChoice: the ring where one rank asks for it) and the window
// of the ring collectives (Note [Windows]).
struct Agreed {
  uint64_t single_copy_bytes;
  uint64_t allgather_algo;
  uint64_t window_bytes;
};
Agreed agree_group_values(Exchange& ex, Agreed mine, Clock::time_point deadline) {
  ex.begin("process group set-up", 0, Clock::now(), deadline);
  std::vector<Agreed> theirs(static_cast<size_t>(ex.size()), mine);
  ex.swap_with_all(&mine, theirs.data(), sizeof(mine));
  for (const Agreed& a : theirs) {
    mine.single_copy_bytes = std::max(mine.single_copy_bytes, a.single_copy_bytes);
    mine.allgather_algo = std::max(mine.allgather_algo, a.allgather_algo);
    mine.window_bytes = std::max(mine.window_bytes, a.window_bytes);
  }
  return mine;
}

// Note [Which allgather]
// ~~~~~~~~~~~~~~~~~~~~~~
// Where the group may read its peers (Note [Single-copy collectives]), an allgather can copy
// each block once with process_vm_readv or twice through the shared-memory ring. Which is
// faster is not a property of the size alone: on the 2-core VM of docs/perf.md the ring won at
// world 2 at every size while a cache line crossed between the cores in about 115 ns, and lost
// by 2-3x from 64 KiB blocks while it took 400-800 ns (the same binary, hours apart;
// docs/perf-history.md). So under TDIST_ALLGATHER_ALGO=auto the group measures both when it is
// made: one allgather of kCalibrationBlockBytes blocks by each (not counted: first touches and
// page faults), then kCalibrationRounds of each, alternated; each rank keeps the fastest of
// each, sends the two to every peer, and all sum them by algorithm, so all ranks take the same
// choice. If the single copy took less, blocks from kMeasuredSingleCopyBytes (or
// TDIST_SINGLE_COPY_BYTES where smaller) are copied once at every world; otherwise the rule
// measured on 2026-11-25 holds: from world 3 only, for blocks of at least
// TDIST_SINGLE_COPY_BYTES (there a single copy also spares waits for the ranks a ring forwards
// through). `ring` never reads a peer; `single_copy` reads from TDIST_SINGLE_COPY_BYTES at every
// world. TDIST_LOG_LEVEL=debug logs the times and what the measurement cost the set-up. It is
// made once: a host whose speeds change later keeps the choice of its set-up.
constexpr size_t kCalibrationBlockBytes = 64 << 10;
constexpr int kCalibrationRounds = 8;
constexpr uint64_t kMeasuredSingleCopyBytes = 32 << 10;

// True when the group's single-copy allgather was faster than its ring, summed over the ranks.
bool single_copy_allgather_is_faster(algorithms::Context& c) {
  const auto began = Clock::now();
  std::vector<char> buffer(kCalibrationBlockBytes * static_cast<size_t>(c.size));
  std::vector<char*> blocks;
  for (int r = 0; r < c.size; ++r) blocks.push_back(buffer.data() + kCalibrationBlockBytes * r);
  std::array<double, 2> mine{1e9, 1e9};  // the fastest, seconds: ring, single copy
  for (int round = 0; round <= kCalibrationRounds; ++round) {
    for (int single = 0; single < 2; ++single) {
      const auto start = Clock::now();
      if (single) {
        algorithms::allgather_single_copy(c, blocks, kCalibrationBlockBytes);
      } else {
        algorithms::allgather_ring(c, blocks, kCalibrationBlockBytes);
      }
      const double took = std::chrono::duration<double>(Clock::now() - start).count();
      if (round > 0) mine[single] = std::min(mine[single], took);
    }
  }
  std::vector<std::array<double, 2>> theirs(static_cast<size_t>(c.size), mine);
  c.ex.swap_with_all(&mine, theirs.data(), sizeof(mine));
  std::array<double, 2> sum{0, 0};
  for (const auto& t : theirs) {
    sum[0] += t[0];
    sum[1] += t[1];
  }
  TDIST_LOG_DEBUG("rank ", c.rank, ": allgathers of ", kCalibrationBlockBytes, "-byte blocks took ",
                  sum[0] * 1e6, " us by ring and ", sum[1] * 1e6,
                  " us by single copy (the fastest of ", kCalibrationRounds,
                  " on each rank, summed); measuring took ",
                  std::chrono::duration<double>(Clock::now() - began).count() * 1e6, " us");
  return sum[1] < sum[0];
}
}  // namespace

RingProcessGroup::RingProcessGroup(std::shared_ptr<Store> root_store, std::string prefix, int rank,
                                   int size, Options opts)
    : root_store_(std::move(root_store)),
      prefix_(std::move(prefix)),
      rank_(rank),
      size_(size),
      opts_(std::move(opts)) {
  TDIST_CHECK_ARG(size >= 1, "world size must be >= 1, got ", size);
  TDIST_CHECK_ARG(rank >= 0 && rank < size, "rank must be in [0, ", size, "), got ", rank);
  TDIST_CHECK_ARG(opts_.timeout.count() > 0, "timeout must be positive, got ",
                  opts_.timeout.count(), " ms");
  const RingTuningValues tuning = resolve_ring_tuning(opts_.ring);
  chunk_bytes_ = tuning.chunk_bytes;
  small_allreduce_bytes_ = tuning.small_allreduce_bytes;
  staging_piece_bytes_ = tuning.staging_piece_bytes;
  window_bytes_ = tuning.window_bytes;
  allreduce_algo_ = tuning.allreduce_algo;
  debug_detail_ = tuning.debug_detail;

  auto store = std::make_shared<PrefixStore>(prefix_, root_store_);
  const auto setup_deadline = deadline_after(opts_.timeout);
  mesh_ = std::make_unique<tcp::Mesh>(
      *store, rank_, size_, 2, tcp::fnv1a(prefix_),
      resolve_token(opts_.token, "ProcessGroup::Options::token").value, setup_deadline);
  ChannelOptions copts;
  copts.allow_shm = tuning.shared_memory;
  copts.shm_capacity = tuning.shm_bytes;
  if (opts_.host) copts.host = *opts_.host;
  copts.group = tcp::fnv1a(prefix_);
  auto channels = make_channels(*mesh_, 0, copts, setup_deadline);
  channels_ = std::move(channels.peers);
  hierarchy_ = find_hierarchy(channels.hosts, rank_);
  if (hierarchy_) {
    TDIST_LOG_DEBUG("rank ", rank_, ": ", hierarchy_->cross.size(), " hosts of ",
                    hierarchy_->local.size(), " ranks: hierarchical allreduce above ",
                    small_allreduce_bytes_, " bytes");
  }
  std::vector<Channel*> peers;
  for (auto& c : channels_) peers.push_back(c.get());
  ops_ =
      std::make_unique<OpQueue>(rank_, tuning.run_on_waiter, static_cast<OpQueue::Runner&>(*this));
  exchange_ = std::make_unique<Exchange>(peers, rank_, &ops_->aborted());
  exchange_->set_spin_us(tuning.spin_us.value_or(default_spin_us(channels_)));
  exchange_->set_busy_poll_ns(
      tuning.busy_poll_ns.value_or(default_busy_poll_ns(channels.hosts, rank_)));
  exchange_->set_wait_alone(tuning.shm_futex);
  if (size_ > 1) {
    bool readable = tuning.single_copy;
    for (int p = 0; p < size_; ++p) {
      readable = readable && (p == rank_ || channels.readable_pids[p] != 0);
    }
    const Agreed agreed =
        agree_group_values(*exchange_,
                           Agreed{readable ? tuning.single_copy_bytes : kNoSingleCopy,
                                  static_cast<uint64_t>(tuning.allgather_algo), window_bytes_},
                           setup_deadline);
    single_copy_bytes_ = agreed.single_copy_bytes;
    window_bytes_ = static_cast<size_t>(agreed.window_bytes);
    if (single_copy_bytes_ != kNoSingleCopy) {
      peer_pids_ = channels.readable_pids;
      peer_pids_[rank_] = ::getpid();
      symmetric_ = std::make_unique<SymmetricMemory>(peer_pids_);
      switch (static_cast<AllgatherChoice>(agreed.allgather_algo)) {
        case AllgatherChoice::kSingleCopy:
          allgather_single_copy_bytes_ = single_copy_bytes_;
          break;
        case AllgatherChoice::kAuto: {
          algorithms::Context ctx = context();
          if (single_copy_allgather_is_faster(ctx)) {
            allgather_single_copy_bytes_ = std::min(single_copy_bytes_, kMeasuredSingleCopyBytes);
          } else if (size_ >= 3) {
            allgather_single_copy_bytes_ = single_copy_bytes_;
          }
          break;
        }
        case AllgatherChoice::kRing:
          break;
      }
    }
  }
  p2p_ = std::make_unique<P2PEngine>(mesh_->channel(1), rank_,
                                     [this](std::exception_ptr e) { abort_with(e); });
  blocks_.reserve(static_cast<size_t>(size_));
  in_blocks_.reserve(static_cast<size_t>(size_));
  ops_->start();
  TDIST_LOG_DEBUG("rank ", rank_, ": process group '", prefix_, "' of ", size_, " ranks is up");
}

RingProcessGroup::~RingProcessGroup() {
  if (ops_->stop()) {
    abort_with(std::make_exception_ptr(
        Error(str("rank ", rank_, ": the process group was destroyed with operations pending"))));
  }
  ops_->join();
  p2p_->stop();
}

void RingProcessGroup::abort() {
  abort_with(std::make_exception_ptr(Error(str("rank ", rank_, ": abort() was called"))));
}

void RingProcessGroup::abort_with(std::exception_ptr cause) {
  if (!ops_->abort(cause)) return;
  TDIST_LOG_WARN("rank ", rank_, ": aborting the process group: ", exception_message(cause));
  // Wakes the thread running an operation (blocked in poll on these sockets, or on a
  // shared-memory channel's futex) and tells every peer at once.
  mesh_->shutdown_all();
  for (auto& c : channels_) {
    if (c) c->shutdown();
  }
  p2p_->abort(cause);
  ops_->fail_queued();
}

std::shared_ptr<Work> RingProcessGroup::enqueue(const char* name, Millis timeout, Fingerprint fp,
                                                Run run) {
  OpBody body;
  body.run = std::move(run);
  body.fingerprint = std::move(fp);
  return ops_->push(name, effective(timeout), std::move(body));
}

std::shared_ptr<Work> RingProcessGroup::enqueue_small(const char* name, Kind kind, Millis timeout,
                                                      Fingerprint fp, SmallArgs args) {
  OpBody body;
  body.kind = kind;
  body.args = std::move(args);
  body.fingerprint = std::move(fp);
  return ops_->push(name, effective(timeout), std::move(body));
}

// Note [Symmetric memory] in symmetric_memory.cpp: allocated as an operation of the group, so
// that every rank's allocation meets its peers' in the same place of the byte streams.
at::Tensor RingProcessGroup::symmetric_empty(const std::vector<int64_t>& sizes,
                                             at::ScalarType dtype) {
  for (int64_t s : sizes) TDIST_CHECK_ARG(s >= 0, "symmetric_empty: negative size ", s);
  if (!symmetric_) return at::empty(sizes, dtype);
  auto work = enqueue("symmetric_empty", Millis(-1), Fingerprint{},
                      [this, sizes, dtype](algorithms::Context& c) {
                        at::Tensor t = symmetric_->allocate(c, sizes, dtype);
                        return t.defined() ? Future::Value{t} : Future::Value{};
                      });
  work->wait();
  const Future::Value got = work->result();
  return got.empty() ? at::empty(sizes, dtype) : got.front();
}

bool RingProcessGroup::is_symmetric(const at::Tensor& t) const {
  return symmetric_ && t.defined() && t.is_cpu() && t.is_contiguous() &&
         symmetric_->holds(static_cast<const char*>(t.data_ptr()), t.nbytes());
}

algorithms::Context RingProcessGroup::context() {
  return {*exchange_, rank_, size_, chunk_bytes_, scratch_, &peer_pids_, window_bytes_};
}

Future::Result RingProcessGroup::run(OpQueue::Op& op, Clock::time_point began) {
  exchange_->begin(op.name, op.seq, began, deadline_after(op.timeout, began));
  OpBody& body = op.body;
  if (debug_detail_) {
    body.fingerprint.op = op.name;
    body.fingerprint.seq = op.seq;
    check_fingerprints(*exchange_, body.fingerprint);
  }
  algorithms::Context ctx = context();
  if (body.kind == Kind::kRun) return body.run(ctx);
  return run_small(ctx, body.kind, body.args);
}

std::shared_ptr<Work> RingProcessGroup::post_p2p(bool is_send, at::Tensor tensor, int peer, int tag,
                                                 Millis timeout) {
  const char* name = is_send ? "send" : (peer < 0 ? "recv_any_source" : "recv");
  check_stageable(tensor, name, "the tensor");
  if (peer >= 0 || is_send) {
    TDIST_CHECK_ARG(peer >= 0 && peer < size_, name, ": peer rank ", peer, " is not in [0, ", size_,
                    ")");
    TDIST_CHECK_ARG(peer != rank_, name, ": rank ", rank_,
                    " cannot send to or receive from itself");
  }
  TDIST_CHECK_ARG(tag >= 0, name, ": tag must be >= 0, got ", tag);
  const uint64_t seq = next_p2p_seq_++;
  auto future = std::make_shared<Future>();
  auto work = std::make_shared<RecvWork>(name, seq, future);
  if (ops_->aborted().load()) {
    future->set_error(ops_->aborted_error(name, seq));
    return work;
  }
  auto deadline = deadline_after(effective(timeout));
  // Large CUDA tensors stream through host memory window by window (Note [Staged messages]);
  // the rest go through a host copy of the whole tensor (`buffer`), which a receive copies back
  // into `tensor` after it completes.
  std::shared_ptr<StagedMessage> staged;
  StandIns stand_ins;
  at::Tensor buffer;
  if (StagedMessage::wanted(tensor, size_, staging_piece_bytes_)) {
    staged = std::make_shared<StagedMessage>(
        is_send ? stand_ins.read(tensor) : stand_ins.written(tensor), is_send, window_bytes_,
        staging_piece_bytes_);
  } else {
    buffer = is_send ? host_values(tensor) : host_output(tensor);
  }
  std::weak_ptr<RecvWork> weak = work;
  auto done = [tensor, buffer, staged, stand_ins, future, weak, is_send](int source,
                                                                         std::exception_ptr error) {
    if (!error && !is_send) {
      try {
        if (staged) {
          staged->complete();
          stand_ins.copy_back();
        } else if (!buffer.is_same(tensor)) {
          tensor.copy_(buffer);
        }
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (!is_send) {
      if (auto w = weak.lock()) w->source_.store(source);
    }
    if (error) {
      future->set_error(error);
    } else {
      future->set_value({tensor});
    }
  };
  if (staged) {
    if (is_send) {
      p2p_->send(staged, tensor.nbytes(), peer, static_cast<uint32_t>(tag), deadline, seq,
                 std::move(done));
    } else {
      p2p_->recv(staged, tensor.nbytes(), peer, static_cast<uint32_t>(tag), deadline, seq,
                 std::move(done));
    }
    return work;
  }
  const size_t bytes = buffer.numel() * buffer.element_size();
  if (is_send) {
    p2p_->send(buffer.data_ptr(), bytes, peer, static_cast<uint32_t>(tag), deadline, seq,
               std::move(done));
  } else {
    p2p_->recv(buffer.data_ptr(), bytes, peer, static_cast<uint32_t>(tag), deadline, seq,
               std::move(done));
  }
  return work;
}

std::shared_ptr<ProcessGroup> RingProcessGroup::new_group(std::vector<int> ranks,
                                                          const Options& opts) {
  TDIST_CHECK_ARG(!ranks.empty(), "new_group: the rank list is empty");
  std::set<int> unique(ranks.begin(), ranks.end());
  TDIST_CHECK_ARG(unique.size() == ranks.size(), "new_group: the rank list has duplicates");
  for (int r : ranks) {
    TDIST_CHECK_ARG(r >= 0 && r < size_, "new_group: rank ", r, " is not in [0, ", size_, ")");
  }
  // Every rank of this group counts every new_group call, member or not, so the prefix agrees.
  const int index = next_subgroup_++;
  std::sort(ranks.begin(), ranks.end());
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  if (it == ranks.end()) return nullptr;
  return std::make_shared<RingProcessGroup>(root_store_, str(prefix_, "/sub", index),
                                            static_cast<int>(it - ranks.begin()),
                                            static_cast<int>(ranks.size()), opts);
}

}  // namespace tdist::comm::detail
