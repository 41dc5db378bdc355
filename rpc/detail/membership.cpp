#include "tdist/rpc/detail/membership.h"

#include <algorithm>
#include <tuple>

#include "tdist/core/logging.h"
#include "tdist/core/rendezvous.h"
#include "tdist/core/serialize.h"
#include "tdist/rpc/detail/deadline.h"

namespace tdist::rpc::detail {

namespace {
const std::string kPrefix = "tdist_rpc/";
}  // namespace

Membership::Membership(WorkerInfo self, const RpcOptions& options, int world_size)
    : self_(std::move(self)) {
  if (options.store) {
    store_ = options.store;
  } else {
    const Millis timeout =
        options.rpc_timeout.count() > 0 ? options.rpc_timeout : Store::kDefaultTimeout;
    store_ = rendezvous(options.init_method, self_.rank, world_size, timeout).store;
  }
}

void Membership::join(int world_size, const std::string& host, uint16_t port, Millis timeout) {
  // The n-th init_rpc of each rank on one store uses keys of incarnation n, so a store that
  // served an earlier RPC group (same ranks) does not mix the two.
  const int64_t incarnation = store_->add(kPrefix + "incarnation/" + std::to_string(self_.rank), 1);
  prefix_ = kPrefix + std::to_string(incarnation) + "/";
  store_->set(prefix_ + "worker/" + std::to_string(self_.rank), encode(self_.name, host, port));
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r) keys.push_back(prefix_ + "worker/" + std::to_string(r));
  try {
    store_->wait(keys, timeout);
  } catch (const TimeoutError& e) {
    throw TimeoutError(str("worker '", self_.name, "' (rank ", self_.rank, ") waited ",
                           timeout.count(), " ms for all ", world_size,
                           " RPC workers to join: ", e.what()));
  }
  workers_.reserve(world_size);
  addresses_.reserve(world_size);
  for (int r = 0; r < world_size; ++r) {
    auto fields = decode<std::tuple<std::string, std::string, uint16_t>>(store_->get(keys[r]));
    WorkerInfo w{std::get<0>(fields), r};
    TDIST_CHECK_ARG(rank_by_name_.emplace(w.name, r).second, "worker name '", w.name,
                    "' is used by ranks ", rank_by_name_[w.name], " and ", r);
    workers_.push_back(w);
    addresses_.emplace_back(std::get<1>(fields), std::get<2>(fields));
  }
  joined_.store(world_size, std::memory_order_release);
}

const WorkerInfo& Membership::worker_info(const To& to) const {
  if (to.by_rank()) {
    TDIST_CHECK_ARG(to.rank() < static_cast<int>(workers_.size()), "no RPC worker with rank ",
                    to.rank(), " (world size ", workers_.size(), ")");
    return workers_[to.rank()];
  }
  auto it = rank_by_name_.find(to.name());
  TDIST_CHECK_ARG(it != rank_by_name_.end(), "no RPC worker named '", to.name(), "'");
  return workers_[it->second];
}

std::string Membership::peer_name(int rank) const {
  if (rank >= 0 && rank < joined_.load(std::memory_order_acquire)) {
    return str("worker '", workers_[rank].name, "' (rank ", rank, ")");
  }
  return str("worker rank ", rank);
}

void Membership::publish_lost_peers(const std::vector<int>& lost) {
  std::vector<int> fresh;
  for (int r : lost) {
    if (lost_published_.insert(r).second) fresh.push_back(r);
  }
  for (int r : fresh) {
    // A worker that finished its shutdown closes its connections too: not gone, just left.
    if (store_->check({prefix_ + "shutdown/exit/" + std::to_string(r)})) continue;
    TDIST_LOG_WARN("rpc: shutdown: worker '", self_.name, "' lost its connection to ", peer_name(r),
                   "; the other workers' shutdown will not wait for it");
    store_->set(prefix_ + "shutdown/gone/" + std::to_string(r), "1");
  }
}

std::vector<bool> Membership::wait_for_workers(const std::string& prefix, int first_rank,
                                               Clock::time_point deadline,
                                               const ShutdownHooks& hooks) {
  static constexpr Millis kPoll{100};
  const int n = world_size();
  const std::string gone = prefix_ + "shutdown/gone/";
  std::vector<bool> present(n, false), resolved(n, false);
  for (int r = 0; r < first_rank; ++r) resolved[r] = true;
  for (;;) {
    std::vector<std::string> missing;
    for (int r = 0; r < n; ++r) {
      if (!resolved[r]) missing.push_back(prefix + std::to_string(r));
    }
    try {
      store_->wait(missing, std::min(kPoll, remaining(deadline)));
      for (int r = first_rank; r < n; ++r) present[r] = present[r] || !resolved[r];
      return present;
    } catch (const TimeoutError&) {
      if (Clock::now() >= deadline) {
        std::string who;
        for (int r = first_rank; r < n; ++r) {
          if (!resolved[r]) who += (who.empty() ? "" : ", ") + peer_name(r);
        }
        throw TimeoutError(
            str("no key ", prefix, "<rank> from ", who, ", and none of them was seen gone"));
      }
    }
    publish_lost_peers(hooks.lost_peers());
    for (int r = first_rank; r < n; ++r) {
      if (resolved[r]) continue;
      const std::string key = prefix + std::to_string(r);
      if (store_->check({key})) {
        present[r] = resolved[r] = true;
      } else if (store_->check({gone + std::to_string(r)})) {
        // Whatever it set, it set before it was seen gone: one more look decides for good.
        resolved[r] = true;
        present[r] = store_->check({key});
      }
    }
    if (store_->check({gone + std::to_string(self_.rank)})) {
      throw Error(str("worker '", self_.name,
                      "' was declared gone by another worker (a "
                      "connection to it broke) while it was still shutting down"));
    }
  }
}

void Membership::shutdown_rounds(Millis limit, const ShutdownHooks& hooks) {
  const auto deadline = Clock::now() + limit;
  const int n = world_size();
  std::vector<std::pair<int64_t, int64_t>> prev;
  for (int round = 0;; ++round) {
    // Round 0 told everybody that this worker is shutting down; from round 1 on, every worker
    // is, and what they still hold is deleted (Note [RPC graceful shutdown]).
    hooks.begin_round(round);
    if (!hooks.wait_idle(deadline)) {
      throw TimeoutError(str("shutdown of worker '", self_.name, "' waited ", limit.count(),
                             " ms for its own work to finish: ", hooks.describe_busy()));
    }
    const std::string round_prefix = prefix_ + "shutdown/" + std::to_string(round) + "/";
    const auto mine = hooks.counts();
    store_->set(round_prefix + std::to_string(self_.rank), encode(mine.first, mine.second));
    std::vector<bool> present;
    try {
      present = wait_for_workers(round_prefix, 0, deadline, hooks);
    } catch (const TimeoutError& e) {
      throw TimeoutError(str("shutdown of worker '", self_.name, "' waited ", limit.count(),
                             " ms for the other workers to shut down (round ", round,
                             "): ", e.what()));
    }
    // A gone worker that never published this round counts as (-1, -1) for everybody alike.
    std::vector<std::pair<int64_t, int64_t>> counts(n, {-1, -1});
    for (int r = 0; r < n; ++r) {
      if (present[r]) {
        counts[r] =
            decode<std::pair<int64_t, int64_t>>(store_->get(round_prefix + std::to_string(r)));
      }
    }
    if (round > 0 && counts == prev) break;
    prev = std::move(counts);
  }
  // The store may live in one of the workers (TCPStore server): leave only when every worker
  // has read the last round.
  store_->set(prefix_ + "shutdown/exit/" + std::to_string(self_.rank), "1");
  wait_for_workers(prefix_ + "shutdown/exit/", 0, deadline, hooks);
  // Rank 0 usually hosts that store (env://): it stays until every other worker's wait above
  // has returned, or an exiting rank 0 could cut another worker's wait off mid-reply. The others'
  // last store call is the "left" mark; its own reply may be cut off, which is harmless.
  const std::string left = prefix_ + "shutdown/left/";
  if (self_.rank == 0) {
    try {
      wait_for_workers(left, 1, deadline, hooks);
    } catch (const std::exception& e) {
      TDIST_LOG_WARN("rpc: shutdown: not every worker confirmed it left the store: ", e.what());
    }
  } else {
    try {
      store_->set(left + std::to_string(self_.rank), "1");
    } catch (const std::exception&) {}
  }
}

}  // namespace tdist::rpc::detail
