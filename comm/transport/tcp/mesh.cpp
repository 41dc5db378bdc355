#include "tdist/comm/transport/tcp/mesh.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "tdist/core/error.h"
#include "tdist/core/hash.h"
#include "tdist/core/logging.h"
#include "tdist/core/net/address.h"
#include "tdist/core/net/handshake.h"
#include "tdist/core/token.h"
#include "tdist/core/wire.h"

namespace tdist::comm::tcp {
namespace {

constexpr size_t kHelloFields = 1 + 4 + 8;  // channel, rank, group (Note [Mesh handshake])
constexpr auto kHelloTimeout = std::chrono::seconds(10);
// Connections in their handshake beyond the expected ones (Note [Mesh handshake]).
constexpr size_t kMaxStrangers = 64;
constexpr auto kMaxAcceptBackoff = std::chrono::milliseconds(100);

std::string addr_key(int rank) { return str("addr/", rank); }

void parse_host_port(const std::string& text, int peer, std::string& host, uint16_t& port) {
  auto colon = text.rfind(':');
  TDIST_CHECK(colon != std::string::npos && colon > 0, "rank ", peer,
              " published a malformed address '", text, "'");
  host = text.substr(0, colon);
  port = static_cast<uint16_t>(std::stoul(text.substr(colon + 1)));
}

}  // namespace

uint64_t fnv1a(const std::string& s) { return fnv1a64(s); }

Mesh::Mesh(Store& store, int rank, int size, int channels, uint64_t group, const std::string& token,
           Clock::time_point deadline)
    : rank_(rank), size_(size), channels_(channels) {
  conns_.resize(static_cast<size_t>(channels));
  for (auto& c : conns_) c.resize(static_cast<size_t>(size));
  if (size == 1) return;
  const std::string host = net::local_address(store.server_host());
  // Note [Secure by default] (core/token.h): decided from the address this rank binds, whatever
  // the store (a group over a HashStore or FileStore as well as a TCPStore).
  require_token_beyond_loopback("the collective mesh", !token.empty(), host,
                                "ProcessGroup::Options::token");
  net::Listener listener(host, 0, 2 * size * channels + 16);
  store.set(addr_key(rank), str(listener.host(), ":", listener.port()));
  connect_lower(store, group, token, deadline);
  accept_higher(group, token, deadline, listener);
}

void Mesh::connect_lower(Store& store, uint64_t group, const std::string& token,
                         Clock::time_point deadline) {
  for (int peer = 0; peer < rank_; ++peer) {
    auto remaining = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    if (remaining.count() <= 0 || !store.check({addr_key(peer)})) {
      try {
        store.wait({addr_key(peer)}, std::max(remaining, Millis(1)));
      } catch (const TimeoutError&) {
        std::string missing;
        for (int p = peer; p < size_; ++p) {
          if (p != rank_ && !store.check({addr_key(p)}))
            missing += str(missing.empty() ? "" : ", ", p);
        }
        TDIST_THROW(TimeoutError, "rank ", rank_,
                    ": timed out creating the process group: ", "rank(s) ", missing,
                    " did not publish their address");
      }
    }
    std::string host;
    uint16_t port = 0;
    parse_host_port(store.get_string(addr_key(peer)), peer, host, port);
    for (int ch = 0; ch < channels_; ++ch) {
      int fd = -1;
      try {
        fd = net::connect_to(host, port, deadline, str("rank ", peer));
      } catch (const TimeoutError& e) {
        TDIST_THROW(TimeoutError, "rank ", rank_,
                    ": timed out creating the process group: ", e.what());
      } catch (const NetworkError& e) {
        TDIST_THROW(NetworkError, "rank ", rank_, ": creating the process group: ", e.what());
      }
      Connection::configure(fd);
      auto conn = std::make_unique<Connection>(fd, peer);
      Bytes fields;
      wire::Writer w(fields);
      w.u8(static_cast<uint8_t>(ch));
      w.u32(static_cast<uint32_t>(rank_));
      w.u64(group);
      net::ClientHandshake handshake(token, net::Service::kMesh);
      try {
        net::client_handshake(fd, handshake, fields, 0, deadline, str("rank ", peer));
      } catch (const TimeoutError& e) {
        TDIST_THROW(TimeoutError, "rank ", rank_,
                    ": timed out creating the process group: ", e.what());
      } catch (const ProtocolError& e) {
        TDIST_THROW(ProtocolError, "rank ", rank_, ": ", e.what());
      }
      conns_[ch][peer] = std::move(conn);
    }
  }
}

// Accepts the higher ranks' connections. Hellos are read from every accepted connection at once
// (one poll over the listener and the connections still in their handshake), so a stranger that
// connects and sends nothing (or trickles) holds up no one: it costs one connection until its own
// 10 s pass, or until it is the oldest when the list is full or descriptors run out.
void Mesh::accept_higher(uint64_t group, const std::string& token, Clock::time_point deadline,
                         net::Listener& listener) {
  struct Pending {
    std::unique_ptr<Connection> conn;
    net::ServerHandshake handshake;
    Bytes hello;
    size_t got = 0;
    Clock::time_point until;
  };
  std::vector<Pending> pending;  // in the order they were accepted
  int expected = (size_ - 1 - rank_) * channels_;
  const size_t max_pending = static_cast<size_t>(expected) + kMaxStrangers;
  int64_t rejected = 0;
  // Logged like the store's refusals: the first ten, then every thousandth.
  const auto note_rejected = [&](const std::string& why) {
    ++rejected;
    if (rejected <= 10 || rejected % 1000 == 0) {
      TDIST_LOG_WARN("rank ", rank_, ": rejected a connection while building the mesh: ", why, " (",
                     rejected, " rejected so far)");
    }
  };
  const auto reject = [&](size_t i, const std::string& why) {
    note_rejected(why);
    pending.erase(pending.begin() + static_cast<long>(i));
  };
  // While the process is out of descriptors and none is ours to free, the listener rests.
  auto listen_again = Clock::time_point::min();
  auto backoff = std::chrono::milliseconds(1);
  bool warned_short = false;
  while (expected > 0) {
    const auto now = Clock::now();
    if (now >= deadline) {
      std::string missing;
      for (int p = rank_ + 1; p < size_; ++p) {
        for (int ch = 0; ch < channels_; ++ch) {
          if (!conns_[ch][p]) {
            missing += str(missing.empty() ? "" : ", ", p);
            break;
          }
        }
      }
      TDIST_THROW(TimeoutError, "rank ", rank_,
                  ": timed out creating the process group: ", "rank(s) ", missing,
                  " did not connect");
    }
    for (size_t i = pending.size(); i-- > 0;) {
      if (now >= pending[i].until) reject(i, "the handshake was not over within 10 s");
    }
    auto wake = deadline;
    const bool listening = now >= listen_again;
    if (!listening) wake = std::min(wake, listen_again);
    std::vector<pollfd> fds{{listener.fd(), static_cast<short>(listening ? POLLIN : 0), 0}};
    for (const auto& p : pending) {
      fds.push_back({p.conn->fd(), POLLIN, 0});
      wake = std::min(wake, p.until);
    }
    int rc = ::poll(fds.data(), fds.size(), net::poll_ms(wake));
    if (rc < 0 && errno != EINTR)
      TDIST_THROW(NetworkError, "poll failed: ", net::errno_text(errno));
    if (rc <= 0) continue;
    // Read what the connections sent, newest first (so erasing keeps the indices below valid).
    for (size_t i = pending.size(); i-- > 0;) {
      if (fds[i + 1].revents == 0) continue;
      Pending& p = pending[i];
      ssize_t n =
          ::recv(p.conn->fd(), p.hello.data() + p.got, p.hello.size() - p.got, MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        reject(i,
               str("the connection ended after ", p.got, " of ", p.hello.size(), " hello bytes"));
        continue;
      }
      if (n < 0) continue;
      p.got += static_cast<size_t>(n);
      if (p.got < p.hello.size()) continue;
      Bytes fields;
      try {
        fields = p.handshake.verify_hello(p.hello.data(), p.hello.size(), kHelloFields);
      } catch (const ProtocolError& e) {
        reject(i, e.what());
        continue;
      }
      wire::Reader r(fields);
      const uint8_t ch = r.u8();
      const uint32_t peer = r.u32();
      const uint64_t their_group = r.u64();
      if (their_group != group) {
        reject(i, str("a hello for another process group (rank ", peer, ")"));
      } else if (ch >= channels_ || peer <= static_cast<uint32_t>(rank_) ||
                 peer >= static_cast<uint32_t>(size_) || conns_[ch][peer]) {
        reject(i, str("unexpected hello from rank ", peer, " channel ", int(ch)));
      } else {
        try {
          const Bytes accept = p.handshake.accept({});
          net::write_all(p.conn->fd(), accept.data(), accept.size(), p.until,
                         str("the handshake answer to rank ", peer));
        } catch (const Error& e) {
          reject(i, e.what());
          continue;
        }
        p.conn->set_peer(static_cast<int>(peer));
        conns_[ch][peer] = std::move(p.conn);
        pending.erase(pending.begin() + static_cast<long>(i));
        --expected;
      }
    }
    if (fds[0].revents == 0) continue;
    int fd = listener.accept(Clock::now());
    if (fd < 0) {
      // A connection waits but could not be taken: this process is out of descriptors
      // (net::Listener::accept). Free one by dropping the oldest connection in its handshake (an
      // honest rank answers its challenge at once); with none to drop, rest a while.
      if (!pending.empty()) {
        reject(0, "dropped to free a descriptor: this process is out of file descriptors");
      } else {
        if (!warned_short) {
          warned_short = true;
          TDIST_LOG_WARN("rank ", rank_, ": out of file descriptors while building the mesh; ",
                         "waiting for one to accept the next connection");
        }
        listen_again = Clock::now() + backoff;
        backoff = std::min<std::chrono::milliseconds>(backoff * 2, kMaxAcceptBackoff);
      }
      continue;
    }
    backoff = std::chrono::milliseconds(1);
    if (pending.size() >= max_pending) {
      reject(0, str("dropped the oldest connection in its handshake (at most ", max_pending,
                    " may wait: the ranks expected and ", kMaxStrangers, " more)"));
    }
    Connection::configure(fd);
    Pending p{std::make_unique<Connection>(fd, -1),
              net::ServerHandshake(token, net::Service::kMesh),
              Bytes(net::hello_bytes(kHelloFields)), 0, Clock::now() + kHelloTimeout};
    try {
      const Bytes& challenge = p.handshake.challenge();
      net::write_all(fd, challenge.data(), challenge.size(), p.until, "the handshake challenge");
      pending.push_back(std::move(p));
    } catch (const Error& e) {
      note_rejected(e.what());
    }
  }
  if (rejected > 10) {
    TDIST_LOG_WARN("rank ", rank_, ": rejected ", rejected,
                   " connections in all while building the mesh");
  }
}

std::vector<Connection*> Mesh::channel(int ch) const {
  std::vector<Connection*> out(static_cast<size_t>(size_));
  for (int p = 0; p < size_; ++p) out[p] = conns_[ch][p].get();
  return out;
}

void Mesh::shutdown_all() {
  for (auto& ch : conns_) {
    for (auto& c : ch) {
      if (c) c->shutdown();
    }
  }
}

}  // namespace tdist::comm::tcp
