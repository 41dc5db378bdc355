#pragma once
// Elastic rendezvous for tdist-run --nnodes MIN:MAX (torchrun's c10d rendezvous): launchers
// ("nodes") meet in rounds on a Store, each round fixes a membership, dense node ranks and a
// fresh master port for the workers; a node that fails or joins ends the round and the
// survivors meet again. The protocol is Note [Elastic rendezvous] in rendezvous.cpp.
//
// Thread safety: none; one launcher thread drives it. Blocking: next_round() and
// wait_finished() poll the store until their deadline (join_timeout) and return early when
// `interrupted()` says so; poll(), end_round() and finish() make a few store requests each.

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tdist/core/store.h"

namespace tdist::run {

struct RendezvousConfig {
  std::string run_id = "none";
  int min_nodes = 1;
  int max_nodes = 1;
  std::string local_addr;  // where other nodes reach this node (published for MASTER_ADDR)
  std::chrono::milliseconds last_call{1000};  // after min_nodes joined, wait this long for more
  std::chrono::milliseconds join_timeout{600000};
  std::chrono::milliseconds keep_alive_interval{1000};
  std::chrono::milliseconds keep_alive_timeout{10000};  // no heartbeat this long: node is gone
  std::chrono::milliseconds poll_interval{50};          // of the blocking waits
  // Called by node rank 0 of each round for the workers' MASTER_PORT (a free port of local_addr).
  std::function<int()> pick_master_port;
  // Checked while waiting: true aborts the wait (next_round returns nullopt with interrupted()).
  std::function<bool()> interrupted;
};

// One round as this node sees it.
struct RoundInfo {
  int64_t round = 0;
  int node_rank = 0;
  int num_nodes = 1;
  std::string master_addr;  // node rank 0's local_addr
  int master_port = 0;      // fresh per round
  int64_t failures = 0;     // rounds that ended by a failure before this one (restarts used)
  std::vector<std::string> node_addrs;  // by node rank
};

enum class RoundEnd { kFailure, kMembershipChange, kDone };

struct RoundEndInfo {
  RoundEnd kind = RoundEnd::kFailure;
  std::string
      reason;  // "node 1 (10.0.0.2): rank 3 exited with code 1", "a node is waiting to join"
};

class ElasticRendezvous {
 public:
  ElasticRendezvous(std::shared_ptr<Store> store, RendezvousConfig config);

  // Joins the first round that is still open (announcing itself to a running round and waiting
  // for it to end, when there is none), and returns that round once it closed with this node in
  // it. nullopt: the job finished without this node (every member of the running round
  // finished), or interrupted() turned true. Throws TimeoutError after join_timeout.
  std::optional<RoundInfo> next_round();

  // Registers in the round after the one that just ended (or that this node ends), without
  // waiting for it to close: call it before stopping the workers so that every survivor is
  // counted in the next round within the last call. next_round() then continues from it.
  void register_next();

  // While the round runs (call every monitor interval): heartbeats when due, and returns why the
  // round ended, if it did: another node ended it, a node is waiting to join (and there is room),
  // or a member stopped heartbeating (this node ends the round then).
  std::optional<RoundEndInfo> poll();

  // Ends the current round (a local worker failed): the first node to end a round wins; a
  // failure counts against --max-restarts. Returns how the round ended (maybe by another node).
  RoundEndInfo end_round(RoundEnd kind, const std::string& reason);

  // This node's workers all succeeded: counts it as finished; when every member has, the round
  // ends as kDone. Then wait_finished() keeps heartbeating until the round ended (true: kDone).
  void finish();
  bool wait_finished(std::string* reason);

  // After the round ended kDone: counts this node as gone. The node serving the store calls
  // wait_all_left() before it stops serving, so no member loses the store before it read "done".
  void leave();
  void wait_all_left(std::chrono::milliseconds limit);

  const RoundInfo& current() const { return round_; }
  bool interrupted() const { return config_.interrupted && config_.interrupted(); }

 private:
  using Clock = std::chrono::steady_clock;

  std::string key(int64_t round, const std::string& name) const;
  bool exists(const std::string& k);
  int64_t read_count(const std::string& k);
  // Polls until `k` exists; false when interrupted. TimeoutError after `deadline`.
  bool wait_key(const std::string& k, Clock::time_point deadline, const std::string& what);
  void close_round(int64_t round, Clock::time_point deadline);
  std::optional<RoundEndInfo> ended(int64_t round);
  void heartbeat_if_due();
  void announce_waiting(int64_t round);
  std::optional<RoundInfo> assign(int64_t round, int64_t members, Clock::time_point deadline);

  // Constant after construction.
  const std::shared_ptr<Store> store_;
  const RendezvousConfig config_;
  const std::string node_id_;

  // The round this node runs in (valid after next_round returned it).
  RoundInfo round_;
  // Registration in a round not yet closed (register_next), or -1.
  int64_t registered_round_ = -1;
  int64_t registered_slot_ = -1;
  int64_t announced_round_ = -1;  // the last round told that this node waits
  Clock::time_point next_heartbeat_{};
  // Per member of the running round: its last heartbeat count and when it last changed.
  std::vector<int64_t> seen_beats_;
  std::vector<Clock::time_point> seen_at_;
};

}  // namespace tdist::run
