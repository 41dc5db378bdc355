// Launcher::run_elastic: the launcher's side of Note [Elastic rendezvous] (rendezvous.cpp):
// meet the other nodes, run one round of workers, and on a failure, a dead node or a joining
// node, register for the next round, stop the workers and meet again.
#include <signal.h>

#include <cstdio>
#include <memory>

#include "apps/run/launcher.h"
#include "apps/run/rendezvous.h"
#include "tdist/core/error.h"
#include "tdist/core/net/address.h"
#include "tdist/core/tcp_store.h"

namespace tdist::run {
namespace {

// How long the store's host waits for the other members to read "done" before it stops serving.
constexpr std::chrono::milliseconds kLeaveGrace{10000};

void note(const std::string& line) { std::fprintf(stderr, "tdist-run: %s\n", line.c_str()); }

}  // namespace

int Launcher::run_elastic() {
  const ElasticOptions& el = config_.elastic;
  // Note [Elastic rendezvous]: the node that can bind the endpoint serves the store.
  std::unique_ptr<TCPStoreServer> server;
  try {
    server =
        std::make_unique<TCPStoreServer>(el.endpoint_host, static_cast<uint16_t>(el.endpoint_port));
  } catch (const NetworkError&) {
    // Another node serves it (or will): connect as a client.
  }
  TCPStoreOptions so;
  so.host = el.endpoint_host;
  so.port = static_cast<uint16_t>(el.endpoint_port);
  so.timeout = el.join_timeout;
  auto store = std::make_shared<TCPStore>(so);

  RendezvousConfig rc;
  rc.run_id = el.run_id;
  rc.min_nodes = el.min_nodes;
  rc.max_nodes = el.max_nodes;
  rc.local_addr =
      el.local_addr.empty() ? net::source_address_toward(el.endpoint_host) : el.local_addr;
  rc.last_call = el.last_call;
  rc.join_timeout = el.join_timeout;
  rc.keep_alive_interval = el.keep_alive_interval;
  rc.keep_alive_timeout = el.keep_alive_timeout;
  const std::string addr = rc.local_addr;
  rc.pick_master_port = [addr] { return pick_free_port(addr); };
  rc.interrupted = [this] { return signal_pending(); };
  ElasticRendezvous rdzv(store, rc);
  note(str("elastic rendezvous '", el.run_id, "' at ",
           net::host_port(el.endpoint_host, el.endpoint_port),
           server ? " (served by this node)" : "", ", nodes ", el.min_nodes, ":", el.max_nodes,
           ", this node ", addr));

  auto stopped_by_signal = [&] {
    note("stopped by " + signal_name(received_signal_) + "; workers stopped");
    return kStoppedBySignalExit;
  };
  std::string last_end;
  for (;;) {
    auto round = rdzv.next_round();
    if (!round) {
      if (received_signal_ != 0) return stopped_by_signal();
      note("the job finished without this node");
      return 0;
    }
    if (round->failures > config_.max_restarts) {
      note(str("round ", round->round, ": ", round->failures, " failures exceed --max-restarts ",
               config_.max_restarts, "; giving up",
               last_end.empty() ? "" : " (last: " + last_end + ")"));
      rdzv.leave();
      if (server) rdzv.wait_all_left(kLeaveGrace);
      return 1;
    }
    restart_count_ = static_cast<int>(round->failures);
    note(str("round ", round->round, ": node rank ", round->node_rank, " of ", round->num_nodes,
             " (world size ", round->num_nodes * config_.nproc_per_node, "), master ",
             round->master_addr, ":", round->master_port));
    Assignment a;
    a.node_rank = round->node_rank;
    a.nnodes = round->num_nodes;
    a.master_addr = round->master_addr;
    a.master_port = round->master_port;
    a.attempt = round->round;
    start_workers(a);
    std::optional<RoundEndInfo> end;
    const Outcome outcome = watch_workers([&] {
      end = rdzv.poll();
      return end.has_value();
    });
    if (outcome == Outcome::kSignal) return stopped_by_signal();
    if (outcome == Outcome::kSuccess) {
      drain_exited();
      rdzv.finish();
      std::string why;
      const bool done = rdzv.wait_finished(&why);
      rdzv.leave();
      if (server) rdzv.wait_all_left(kLeaveGrace);
      if (done) return 0;
      note("this node's workers finished but the job did not: " + why);
      return 1;
    }
    if (outcome == Outcome::kFailure) {
      end = rdzv.end_round(RoundEnd::kFailure,
                           str("node ", round->node_rank, " (", addr, "): ", failure_->describe()));
    }
    // Note [Elastic rendezvous] 5: count this node in the next round before stopping workers.
    rdzv.register_next();
    stop_all(SIGTERM);
    last_end = end->reason;
    note(str("round ", round->round, " ended (", end->reason, "); meeting again"));
    if (outcome == Outcome::kFailure) report_failure(*failure_);
  }
}

}  // namespace tdist::run
