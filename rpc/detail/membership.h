#pragma once
// Membership: who the workers of one RPC group are, and how they leave it together.
//
// It owns the group's store. join() publishes this worker's name and address under its
// incarnation's keys (the n-th init_rpc of a rank on one store uses incarnation n) and waits
// until every worker has; the directory it reads then (names, ranks, addresses) does not change
// afterwards. shutdown_rounds() runs Note [RPC graceful shutdown] (rpc/agent.h) through the same
// store: rounds of request counts until two agree, the gone marks of workers whose connection
// broke, and the exit and left marks that let the worker hosting the store leave last.
//
// Locking: none of its own. The directory is written by join() while the agent starts and read
// by every thread afterwards; shutdown_rounds() runs on one thread at a time (RpcAgent::shutdown
// serializes it), which alone touches lost_published_.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tdist/core/store.h"
#include "tdist/rpc/types.h"

namespace tdist::rpc::detail {

// What the shutdown rounds need from the rest of the agent.
struct ShutdownHooks {
  // Called at the start of each round; from round 1 on every worker is shutting down and the
  // user RRefs still held are deleted.
  std::function<void(int round)> begin_round;
  // Waits until no call is pending and no incoming call runs; false at the deadline.
  std::function<bool(Clock::time_point deadline)> wait_idle;
  // What keeps the worker busy, for the timeout's message.
  std::function<std::string()> describe_busy;
  // Requests sent and received so far.
  std::function<std::pair<int64_t, int64_t>()> counts;
  // The peers whose established connection broke.
  std::function<std::vector<int>()> lost_peers;
};

class Membership {
 public:
  // Meets the others' store: RpcOptions::store, else a rendezvous on init_method (timeout:
  // rpc_timeout, or the store's default when that is 0).
  Membership(WorkerInfo self, const RpcOptions& options, int world_size);

  Store& store() const { return *store_; }
  const WorkerInfo& self() const { return self_; }

  // Publishes this worker at host:port and waits up to `timeout` for all world_size workers.
  // TimeoutError naming this worker; InvalidArgument for a name two ranks use.
  void join(int world_size, const std::string& host, uint16_t port, Millis timeout);

  // The directory (empty before join()).
  int world_size() const { return static_cast<int>(workers_.size()); }
  const std::vector<WorkerInfo>& workers() const { return workers_; }
  // InvalidArgument for an unknown name or a rank out of range.
  const WorkerInfo& worker_info(const To& to) const;
  const std::pair<std::string, uint16_t>& address(int rank) const { return addresses_.at(rank); }
  // "worker 'name' (rank r)", or "worker rank r" for a rank the directory does not have.
  std::string peer_name(int rank) const;

  // Note [RPC graceful shutdown]: returns once two rounds agree and every worker read the last
  // one. TimeoutError after `limit`; Error when another worker declared this one gone.
  void shutdown_rounds(Millis limit, const ShutdownHooks& hooks);

 private:
  // Waits until each worker r >= first_rank has set prefix + r, or is gone; returns, per rank,
  // whether its key is there. TimeoutError at `deadline`.
  std::vector<bool> wait_for_workers(const std::string& prefix, int first_rank,
                                     Clock::time_point deadline, const ShutdownHooks& hooks);
  // Marks in the store the peers whose connection broke while this agent ran.
  void publish_lost_peers(const std::vector<int>& lost);

  // Constant after construction.
  WorkerInfo self_;
  std::shared_ptr<Store> store_;
  // Written by join(), constant afterwards.
  std::string prefix_;  // this incarnation's keys
  // Reserved whole before join() fills it, so its entries never move: peer_name() reads the
  // first joined_ of them from the accept and reader threads while join() still runs.
  std::vector<WorkerInfo> workers_;
  std::vector<std::pair<std::string, uint16_t>> addresses_;
  std::map<std::string, int> rank_by_name_;
  // The shutdown thread's: lost peers already marked gone in the store.
  std::set<int> lost_published_;
  // How many of workers_ peer_name() may read: world_size once join() is done, 0 before.
  std::atomic<int> joined_{0};
};

}  // namespace tdist::rpc::detail
