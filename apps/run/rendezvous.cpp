#include "apps/run/rendezvous.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <sstream>
#include <thread>
#include <tuple>

#include "tdist/core/env.h"
#include "tdist/core/error.h"

namespace tdist::run {

// Note [Elastic rendezvous]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// tdist-run --nnodes MIN:MAX --rdzv-endpoint HOST:PORT --rdzv-id JOB: every launcher ("node")
// talks to one TCPStore at HOST:PORT. The launcher that can bind HOST:PORT serves it (torchrun's
// c10d backend does the same), the others connect to it; the store lives as long as that
// launcher, so the node on HOST must outlive the job. All keys sit under "rdzv/<JOB>/"; a round
// n uses the keys "r<n>/...". A node moves through: JOINING -> (WAITING ->) RUNNING -> ENDED ->
// JOINING the next round ... -> FINISHED.
//
//  1. Joining round n. A round is open until "r<n>/members" exists. A node takes a slot with
//     v = add("r<n>/count", 1) and writes "r<n>/node/<v-1>" = "<prev round> <prev node rank>
//     <address> <node id>". The node in slot 0 closes the round: once MIN nodes have joined it
//     waits `last call` seconds for more (less when MAX joined), then closes with one atomic
//     add("r<n>/count", kClosed): the value before it is the number of registrations that won,
//     and "r<n>/members" = min(that, MAX) is published. A registration whose add returned more
//     than kClosed came after the close; slots >= members (over MAX) are left out too. Nodes
//     left out, and nodes that find the round closed, are WAITING (2).
//  2. Waiting. A node that cannot join round n adds 1 to "r<n>/waiting" (once) and waits for
//     "r<n>/end"; then it joins round n+1. When round n ended "done", the job finished without
//     it and it exits 0.
//  3. Running. Members read every slot's record and sort by (most recent previous round first,
//     previous node rank, slot): survivors keep their relative order (node rank 0 stays rank 0
//     while it lives), newcomers come last in arrival order. Node ranks are the positions: dense
//     0..members-1. Node rank 0 picks a free port on its address and publishes
//     "r<n>/master_port": every round gets a fresh MASTER_PORT, so workers of an old round can
//     never reach the store of a new one. Workers get WORLD_SIZE = members x nproc_per_node and
//     RANK = node rank x nproc_per_node + local rank, and resume from their checkpoint.
//  4. Liveness. Every member adds 1 to "r<n>/hb/<node rank>" every keep-alive interval and
//     watches the others' counters: one that has not moved for the keep-alive timeout (measured
//     on the watcher's clock; no clocks are compared) is a dead node. Every monitor interval a
//     member also checks "r<n>/end" and "r<n>/waiting".
//  5. Ending a round. A member ends round n when a local worker fails, a member is dead, or a
//     node waits to join while members < MAX (and no member has finished). The first to
//     compare_set("r<n>/end_claim", "", its id) wins: for a failure it adds 1 to "failures",
//     then it sets "r<n>/end" = "<kind> <reason>". Everyone else sees "r<n>/end" at its next
//     poll. A member first registers in round n+1 (1), then stops its workers, so all survivors
//     are counted within the last call even when stopping takes a while.
//  6. Restarts. Round n+1's members read "failures" (set before "r<n>/end", so all read the same
//     value): more than --max-restarts and every member gives up with exit code 1. Rounds ended
//     by a join do not count (torchrun's rule).
//  7. Finishing. A member whose workers all succeeded sets "r<n>/finished/<rank>" (dead-node
//     checks skip it) and adds 1 to "r<n>/finished"; the member that brings it to `members`
//     ends the round "done". Members keep heartbeating until the end, then add 1 to
//     "r<n>/left", as do the nodes that waited on round n when they read "done" (and every
//     member of a round that gives up, 6); the node serving the store waits (bounded) until
//     members + waiting nodes have left before it exits.
//
// Invariants: a round's membership, ranks and master port are fixed once "r<n>/members" is
// published; a round ends at most once (end_claim); every round's keys are distinct, so nothing
// of an old round is read by a newer one. Limits: the store's host is a single point of failure
// (as in torchrun's c10d backend); the slot-0 node must live until it closed the round.

namespace {

constexpr int64_t kClosed = int64_t(1) << 40;

const char* kind_name(RoundEnd k) {
  switch (k) {
    case RoundEnd::kFailure:
      return "failure";
    case RoundEnd::kMembershipChange:
      return "membership";
    case RoundEnd::kDone:
      return "done";
  }
  return "failure";
}

struct SlotRecord {
  int64_t prev_round = -1;
  int prev_rank = -1;
  std::string addr;
  std::string node_id;
  int64_t slot = 0;
};

SlotRecord parse_record(const std::string& text, int64_t slot) {
  SlotRecord r;
  r.slot = slot;
  std::istringstream in(text);
  in >> r.prev_round >> r.prev_rank >> r.addr >> r.node_id;
  TDIST_CHECK(!in.fail(), "rendezvous: malformed node record '", text, "' in slot ", slot);
  return r;
}

std::string make_node_id() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::random_device rd;
  return str(host, ":", ::getpid(), ":", std::hex, rd());
}

}  // namespace

ElasticRendezvous::ElasticRendezvous(std::shared_ptr<Store> store, RendezvousConfig config)
    : store_(std::move(store)), config_(std::move(config)), node_id_(make_node_id()) {
  TDIST_CHECK_ARG(config_.min_nodes >= 1 && config_.min_nodes <= config_.max_nodes,
                  "--nnodes MIN:MAX needs 1 <= MIN <= MAX, got ", config_.min_nodes, ":",
                  config_.max_nodes);
  TDIST_CHECK_ARG(!config_.local_addr.empty() && config_.local_addr.find(' ') == std::string::npos,
                  "rendezvous: bad local address '", config_.local_addr, "'");
  TDIST_CHECK_ARG(static_cast<bool>(config_.pick_master_port), "rendezvous: no port picker");
  round_.round = -1;
  round_.node_rank = -1;
}

std::string ElasticRendezvous::key(int64_t round, const std::string& name) const {
  std::string k = "rdzv/" + config_.run_id + "/";
  if (round >= 0) k += "r" + std::to_string(round) + "/";
  return k + name;
}

bool ElasticRendezvous::exists(const std::string& k) { return store_->check({k}); }

int64_t ElasticRendezvous::read_count(const std::string& k) { return store_->add(k, 0); }

bool ElasticRendezvous::wait_key(const std::string& k, Clock::time_point deadline,
                                 const std::string& what) {
  while (!exists(k)) {
    if (interrupted()) return false;
    if (Clock::now() >= deadline) {
      TDIST_THROW(TimeoutError, "rendezvous '", config_.run_id, "': timed out after ",
                  config_.join_timeout.count() / 1000.0, " s waiting for ", what);
    }
    std::this_thread::sleep_for(config_.poll_interval);
  }
  return true;
}

std::optional<RoundEndInfo> ElasticRendezvous::ended(int64_t round) {
  const std::string k = key(round, "end");
  if (!exists(k)) return std::nullopt;
  const std::string text = store_->get_string(k);
  const auto space = text.find(' ');
  const std::string kind = text.substr(0, space);
  RoundEndInfo e;
  e.kind = kind == "done"         ? RoundEnd::kDone
           : kind == "membership" ? RoundEnd::kMembershipChange
                                  : RoundEnd::kFailure;
  e.reason = space == std::string::npos ? "" : text.substr(space + 1);
  return e;
}

void ElasticRendezvous::announce_waiting(int64_t round) {
  if (announced_round_ == round) return;
  announced_round_ = round;
  store_->add(key(round, "waiting"), 1);
}

void ElasticRendezvous::close_round(int64_t round, Clock::time_point deadline) {
  const std::string count_key = key(round, "count");
  std::optional<Clock::time_point> min_reached;
  for (;;) {
    const int64_t joined = read_count(count_key);
    if (joined >= config_.max_nodes) break;
    if (joined >= config_.min_nodes) {
      if (!min_reached) min_reached = Clock::now();
      if (Clock::now() - *min_reached >= config_.last_call) break;
    }
    if (interrupted()) return;
    if (Clock::now() >= deadline) {
      TDIST_THROW(TimeoutError, "rendezvous '", config_.run_id, "': only ", joined, " of at least ",
                  config_.min_nodes, " nodes joined round ", round, " within ",
                  config_.join_timeout.count() / 1000.0, " s");
    }
    std::this_thread::sleep_for(config_.poll_interval);
  }
  const int64_t registered = store_->add(count_key, kClosed) - kClosed;
  const int64_t members = std::min<int64_t>(registered, config_.max_nodes);
  store_->set(key(round, "members"), std::to_string(members));
  store_->set(key(-1, "round"), std::to_string(round));
}

void ElasticRendezvous::register_next() {
  const int64_t n = round_.round + 1;
  const int64_t v = store_->add(key(n, "count"), 1);
  if (v > kClosed) return;  // round n already closed: next_round() waits for the one after
  registered_round_ = n;
  registered_slot_ = v - 1;
  store_->set(key(n, "node/" + std::to_string(registered_slot_)),
              str(round_.round, " ", round_.node_rank, " ", config_.local_addr, " ", node_id_));
}

std::optional<RoundInfo> ElasticRendezvous::next_round() {
  const auto deadline = Clock::now() + config_.join_timeout;
  int64_t n = registered_round_;
  int64_t slot = registered_slot_;
  registered_round_ = registered_slot_ = -1;
  if (n < 0) {
    // A fresh node starts at the newest round it can find; "round" is a hint set at each close.
    n = std::max(round_.round + 1, exists(key(-1, "round")) ? read_count(key(-1, "round")) : 0);
  }
  for (;;) {
    if (slot < 0) {
      if (auto e = ended(n)) {
        if (e->kind == RoundEnd::kDone) {  // the job finished without us
          if (announced_round_ == n) store_->add(key(n, "left"), 1);
          return std::nullopt;
        }
        ++n;
        continue;
      }
      if (exists(key(n, "members"))) {  // running: wait for it to end (2)
        announce_waiting(n);
        if (!wait_key(key(n, "end"), deadline,
                      str("round ", n, " to end (this node waits to join)")))
          return std::nullopt;
        continue;
      }
      const int64_t v = store_->add(key(n, "count"), 1);
      if (v > kClosed) {  // closed between our check and our add
        if (!wait_key(key(n, "members"), deadline, str("round ", n, " to publish its members")))
          return std::nullopt;
        continue;
      }
      slot = v - 1;
      store_->set(key(n, "node/" + std::to_string(slot)),
                  str(round_.round, " ", round_.node_rank, " ", config_.local_addr, " ", node_id_));
    }
    if (slot == 0) close_round(n, deadline);
    if (!wait_key(key(n, "members"), deadline, str("round ", n, " to close"))) return std::nullopt;
    const int64_t members = read_count(key(n, "members"));
    if (slot < members) return assign(n, members, deadline);
    slot = -1;  // over MAX: wait for the next round
  }
}

std::optional<RoundInfo> ElasticRendezvous::assign(int64_t round, int64_t members,
                                                   Clock::time_point deadline) {
  std::vector<SlotRecord> records;
  for (int64_t s = 0; s < members; ++s) {
    const std::string k = key(round, "node/" + std::to_string(s));
    if (!wait_key(k, deadline, str("the record of slot ", s, " of round ", round)))
      return std::nullopt;
    records.push_back(parse_record(store_->get_string(k), s));
  }
  // Note [Elastic rendezvous] 3: survivors of the latest round first, in their old order.
  std::sort(records.begin(), records.end(), [](const SlotRecord& a, const SlotRecord& b) {
    return std::make_tuple(-a.prev_round, a.prev_rank, a.slot) <
           std::make_tuple(-b.prev_round, b.prev_rank, b.slot);
  });
  RoundInfo info;
  info.round = round;
  info.num_nodes = static_cast<int>(members);
  info.node_rank = -1;
  for (size_t i = 0; i < records.size(); ++i) {
    info.node_addrs.push_back(records[i].addr);
    if (records[i].node_id == node_id_) info.node_rank = static_cast<int>(i);
  }
  TDIST_CHECK(info.node_rank >= 0, "rendezvous: this node is not among round ", round,
              "'s records");
  info.master_addr = info.node_addrs[0];
  const std::string port_key = key(round, "master_port");
  if (info.node_rank == 0) store_->set(port_key, std::to_string(config_.pick_master_port()));
  if (!wait_key(port_key, deadline, str("round ", round, "'s master port"))) return std::nullopt;
  info.master_port =
      static_cast<int>(env::parse_int(port_key, store_->get_string(port_key), 1, 65535));
  info.failures = exists(key(-1, "failures")) ? read_count(key(-1, "failures")) : 0;

  round_ = info;
  seen_beats_.assign(members, -1);
  seen_at_.assign(members, Clock::now());
  next_heartbeat_ = Clock::now();
  heartbeat_if_due();
  return info;
}

void ElasticRendezvous::heartbeat_if_due() {
  const auto now = Clock::now();
  if (now < next_heartbeat_) return;
  next_heartbeat_ = now + config_.keep_alive_interval;
  store_->add(key(round_.round, "hb/" + std::to_string(round_.node_rank)), 1);
}

std::optional<RoundEndInfo> ElasticRendezvous::poll() {
  const bool beat_due = Clock::now() >= next_heartbeat_;
  heartbeat_if_due();
  if (auto e = ended(round_.round)) return e;
  const bool someone_finished = read_count(key(round_.round, "finished")) > 0;
  if (!someone_finished && round_.num_nodes < config_.max_nodes) {
    const int64_t waiting = read_count(key(round_.round, "waiting"));
    if (waiting > 0) {
      return end_round(RoundEnd::kMembershipChange,
                       str(waiting, " node(s) waiting to join ", round_.num_nodes, " running"));
    }
  }
  if (!beat_due) return std::nullopt;
  // Note [Elastic rendezvous] 4: peers' heartbeats, checked once per keep-alive interval.
  const auto now = Clock::now();
  for (int j = 0; j < round_.num_nodes; ++j) {
    if (j == round_.node_rank) continue;
    if (exists(key(round_.round, "finished/" + std::to_string(j)))) continue;
    const int64_t beats = read_count(key(round_.round, "hb/" + std::to_string(j)));
    if (beats != seen_beats_[j]) {
      seen_beats_[j] = beats;
      seen_at_[j] = now;
    } else if (now - seen_at_[j] >= config_.keep_alive_timeout) {
      return end_round(RoundEnd::kFailure,
                       str("node ", j, " (", round_.node_addrs[j], ") sent no heartbeat for ",
                           std::chrono::duration<double>(now - seen_at_[j]).count(), " s"));
    }
  }
  return std::nullopt;
}

RoundEndInfo ElasticRendezvous::end_round(RoundEnd kind, const std::string& reason) {
  const int64_t n = round_.round;
  const Bytes me = to_bytes(node_id_);
  if (store_->compare_set(key(n, "end_claim"), {}, me) == me) {
    if (kind == RoundEnd::kFailure) store_->add(key(-1, "failures"), 1);
    store_->set(key(n, "end"), std::string(kind_name(kind)) + " " + reason);
  }
  const auto deadline = Clock::now() + config_.join_timeout;
  // The winner sets "end" right after its claim; interrupted or not, wait for it briefly.
  while (!exists(key(n, "end")) && Clock::now() < deadline) {
    std::this_thread::sleep_for(config_.poll_interval);
  }
  auto e = ended(n);
  TDIST_CHECK(e.has_value(), "rendezvous: round ", n, " was claimed but never ended");
  return *e;
}

void ElasticRendezvous::finish() {
  store_->set(key(round_.round, "finished/" + std::to_string(round_.node_rank)), "1");
  if (store_->add(key(round_.round, "finished"), 1) == round_.num_nodes) {
    end_round(RoundEnd::kDone, "every node finished");
  }
}

bool ElasticRendezvous::wait_finished(std::string* reason) {
  for (;;) {
    if (auto e = poll()) {
      if (reason) *reason = e->reason;
      return e->kind == RoundEnd::kDone;
    }
    if (interrupted()) {
      if (reason) *reason = "interrupted";
      return false;
    }
    std::this_thread::sleep_for(config_.poll_interval);
  }
}

void ElasticRendezvous::leave() { store_->add(key(round_.round, "left"), 1); }

void ElasticRendezvous::wait_all_left(std::chrono::milliseconds limit) {
  const auto deadline = Clock::now() + limit;
  // Members and the nodes that waited to join this round (they leave when they read "done").
  auto expected = [&] { return round_.num_nodes + read_count(key(round_.round, "waiting")); };
  while (read_count(key(round_.round, "left")) < expected() && Clock::now() < deadline) {
    std::this_thread::sleep_for(config_.poll_interval);
  }
}

}  // namespace tdist::run
