#pragma once
// Mesh: a full mesh of TCP connections among the ranks of one group, `channels` connections per
// pair of ranks (the ring backend uses channel 0 for collectives and channel 1 for
// point-to-point messages, so that the two never share a byte stream).
//
// Note [Mesh handshake]
//   1. Every rank listens on local_address(store.server_host()):0 (an address its peers can
//      reach; see core/net/address.h) and publishes "host:port" under "addr/<rank>" in the
//      (group-prefixed) store.
//   2. Rank r connects to every lower rank j, once per channel, and sends a 24-byte hello:
//      u32 magic 'TDCM' | u16 version | u8 channel | u8 0 | u32 rank | u32 0 | u64 group token.
//      It needs no reply: the listen backlog holds the connection until j accepts it, so the
//      lower ranks never wait on the higher ones to connect (no cycle, no deadlock).
//   3. Rank r then accepts the connections of the higher ranks and checks each hello (magic,
//      version, token, rank in range and not yet connected on that channel). A bad hello closes
//      that connection only and is logged; the rank keeps accepting until the deadline.
// Every step is bounded by one deadline; a TimeoutError names the ranks that did not show up.
//
// Thread safety: built by one thread; afterwards connections are used as documented in
// connection.h and shutdown_all() may be called from any thread.

#include <memory>
#include <string>
#include <vector>

#include "tdist/comm/transport/tcp/connection.h"
#include "tdist/core/store.h"

namespace tdist::comm::tcp {

class Mesh {
 public:
  // Blocks until connected to every peer on every channel or until `deadline`.
  Mesh(Store& store, int rank, int size, int channels, uint64_t token, Clock::time_point deadline);
  ~Mesh() = default;
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // nullptr for this rank itself.
  Connection* get(int channel, int peer) const { return conns_[channel][peer].get(); }
  // The connections of one channel indexed by rank (nullptr at this rank).
  std::vector<Connection*> channel(int channel) const;
  void shutdown_all();

 private:
  void connect_lower(Store& store, uint64_t token, Clock::time_point deadline);
  void accept_higher(uint64_t token, Clock::time_point deadline, net::Listener& listener);

  const int rank_;
  const int size_;
  const int channels_;
  std::vector<std::vector<std::unique_ptr<Connection>>> conns_;  // [channel][rank]
};

// FNV-1a of a string: a token that every rank computes alike for a group's store prefix.
uint64_t fnv1a(const std::string& s);

}  // namespace tdist::comm::tcp
