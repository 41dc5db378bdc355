#pragma once
// Mesh: a full mesh of TCP connections among the ranks of one group, `channels` connections per
// pair of ranks (the ring backend uses channel 0 for collectives and channel 1 for
// point-to-point messages, so that the two never share a byte stream).
//
// Note [Mesh handshake]
//   1. Every rank listens on local_address(store.server_host()):0 (an address its peers can
//      reach; see core/net/address.h) and publishes "host:port" under "addr/<rank>" in the
//      (group-prefixed) store. Beyond loopback without a token it refuses to listen unless
//      TDIST_ALLOW_NO_TOKEN=1 (Note [Secure by default] in core/token.h).
//   2. Rank r connects to every lower rank j, once per channel, and runs the client side of the
//      connection handshake (service "mesh", Note [Connection handshake] in
//      core/net/handshake.h) with the job's token; its hello carries 13 bytes of fields:
//      u8 channel | u32 rank | u64 group (FNV-1a of the group's store prefix, so that a
//      connection meant for another group of the same job is told apart).
//      The wait for j's answer cannot deadlock: j answers once it reaches step 3, which needs
//      only the ranks below j (by induction, rank 0 answers at once).
//   3. Rank r then accepts the connections of the higher ranks and runs the server side of the
//      handshake on all of them at once (one poll loop): a stranger that connects and says
//      nothing, or trickles, holds up no one and is dropped after 10 s. It checks the MAC (the
//      token), the group, the rank (above r, in range) and the channel (not yet connected). A
//      connection that fails any check is closed without an answer and logged (the first ten
//      and every thousandth, as the store does); the rank keeps accepting until the deadline.
//      At most the expected connections plus 64 wait in their handshake: the oldest is dropped
//      for a newer one, and for a descriptor when the process runs out of them (EMFILE/ENFILE;
//      with none to drop, the rank waits 1 ms doubling to 100 ms and accepts again), so a flood
//      of strangers costs a bounded number of descriptors and never fails the group's creation.
//      An honest rank answers its challenge at once, so it is seldom the oldest; a flood fast
//      enough to drop it anyway fails that rank's creation with "connection closed by the peer".
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
  // Blocks until connected to every peer on every channel or until `deadline`. `group` tells
  // this group's connections from other groups' (fnv1a of its store prefix); `token` is the
  // job's shared secret (empty: none), which every peer must have.
  Mesh(Store& store, int rank, int size, int channels, uint64_t group, const std::string& token,
       Clock::time_point deadline);
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
  void connect_lower(Store& store, uint64_t group, const std::string& token,
                     Clock::time_point deadline);
  void accept_higher(uint64_t group, const std::string& token, Clock::time_point deadline,
                     net::Listener& listener);

  const int rank_;
  const int size_;
  const int channels_;
  std::vector<std::vector<std::unique_ptr<Connection>>> conns_;  // [channel][rank]
};

// FNV-1a of a string: a group id that every rank computes alike from a group's store prefix.
uint64_t fnv1a(const std::string& s);

}  // namespace tdist::comm::tcp
