#include "tdist/core/detail/tcp_store_client.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "tdist/core/detail/store_util.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/net/address.h"
#include "tdist/core/net/handshake.h"
#include "tdist/core/tcp_store.h"

namespace tdist::detail {
namespace {

using Clock = std::chrono::steady_clock;
using tcp_store::Command;

constexpr size_t kMaxIdleSockets = 8;

// An idle socket is usable when it has nothing to read: readable means EOF or junk.
bool idle_socket_usable(int fd) {
  pollfd p{fd, POLLIN, 0};
  int rc = ::poll(&p, 1, 0);
  return rc == 0;
}

}  // namespace

TCPStoreClient::TCPStoreClient(std::string host, uint16_t port, Millis connect_timeout,
                               std::string token)
    : host_(std::move(host)),
      port_(port),
      address_(net::host_port(host_, port_)),
      connect_timeout_(connect_timeout),
      token_(std::move(token)) {
  try {
    net::resolve(host_, port_);  // a host that does not resolve fails at once, not at the timeout
  } catch (const NetworkError& e) {
    TDIST_THROW(NetworkError, "TCPStore: cannot connect to ", address_, ": ", e.what());
  }
  idle_.push_back(connect(deadline_after(connect_timeout_), connect_timeout_));
}

TCPStoreClient::~TCPStoreClient() {
  for (int fd : idle_) ::close(fd);
}

int TCPStoreClient::connect(Clock::time_point deadline, Millis limit) {
  std::string last_error = "no attempt made";
  auto backoff = Millis(10);
  for (;;) {
    int fd = -1;
    try {
      // One attempt is bounded so that a dropped SYN is retried rather than waited on for minutes.
      fd = net::connect_once(
          host_, port_, std::min(deadline, Clock::now() + std::chrono::seconds(2)), "the TCPStore");
    } catch (const NetworkError& e) {
      last_error = e.what();
    }
    if (fd >= 0) {
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      net::set_dead_peer_timeout(fd, net::dead_peer_timeout());  // Note [Vanished hosts]
      try {
        net::ClientHandshake handshake(token_, net::Service::kStore);
        net::client_handshake(fd, handshake, {}, 0, deadline, "the TCPStore at " + address_);
        return fd;
      } catch (const ProtocolError&) {
        ::close(fd);
        throw;  // refused (another token) or not a store: retrying cannot help
      } catch (const TimeoutError&) {
        // Connected, but no handshake by the deadline: the server is there and does not
        // answer (a stopped process, a full backlog that is never accepted).
        ::close(fd);
        TDIST_THROW(TimeoutError, "TCPStore at ", address_, ": no handshake within ",
                    seconds_text(limit), " s (the server is unresponsive)");
      } catch (const Error& e) {
        ::close(fd);  // e.g. closed at accept (the server's connection limit): retry
        last_error = e.what();
      }
    }
    auto now = Clock::now();
    if (now >= deadline) break;
    // The server may not be up yet: retry with a growing pause.
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, Millis(500));
  }
  TDIST_THROW(NetworkError, "TCPStore: could not connect to ", address_, " within ",
              seconds_text(limit), " s (last error: ", last_error, ")");
}

int TCPStoreClient::take_socket(Clock::time_point deadline, Millis limit) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (!idle_.empty()) {
      int fd = idle_.back();
      idle_.pop_back();
      if (idle_socket_usable(fd)) return fd;
      ::close(fd);  // closed by the server (or junk on it): not reusable
    }
  }
  // Connecting is bounded by both the request's limit and the store's connect timeout.
  Clock::time_point connect_deadline = std::min(deadline, deadline_after(connect_timeout_));
  Millis connect_limit =
      limit == Store::kNoTimeout
          ? connect_timeout_
          : (connect_timeout_ == Store::kNoTimeout ? limit : std::min(limit, connect_timeout_));
  return connect(connect_deadline, connect_limit);
}

void TCPStoreClient::give_back(int fd) {
  std::lock_guard<std::mutex> lock(mu_);
  if (idle_.size() < kMaxIdleSockets) {
    idle_.push_back(fd);
  } else {
    ::close(fd);
  }
}

TCPStoreClient::Reply TCPStoreClient::request(Command cmd, const Bytes& body, Millis limit,
                                              const std::string& what) {
  TDIST_CHECK_ARG(body.size() <= TCPStoreServer::kMaxFrameBytes, "TCPStore ", what, ": request of ",
                  body.size(), " bytes exceeds the frame limit of ",
                  TCPStoreServer::kMaxFrameBytes);
  const Clock::time_point deadline = deadline_after(limit);
  int fd = take_socket(deadline, limit);
  try {
    Bytes frame = tcp_store::make_frame(static_cast<uint16_t>(cmd), body);
    net::write_all(fd, frame.data(), frame.size(), deadline, "send");

    uint8_t header_bytes[tcp_store::kHeaderBytes];
    net::read_exact(fd, header_bytes, sizeof(header_bytes), deadline, "receive");
    tcp_store::Header h = tcp_store::decode_header(header_bytes);
    std::string problem = tcp_store::header_problem(h, TCPStoreServer::kMaxFrameBytes);
    if (problem.empty() && h.code > static_cast<uint16_t>(tcp_store::Status::kInvalid)) {
      problem = str("unknown reply status ", h.code);
    }
    if (!problem.empty()) throw ProtocolError(problem);
    Reply reply;
    reply.status = static_cast<tcp_store::Status>(h.code);
    // The body grows with the bytes that arrive (at most doubling), so a header that declares
    // more than the server sends costs memory in proportion to what it sent, not to its claim.
    constexpr uint64_t kFirstChunk = uint64_t(1) << 20;
    uint64_t got = 0;
    while (got < h.body_bytes) {
      const uint64_t n = std::min(h.body_bytes - got, std::max(kFirstChunk, got));
      reply.body.resize(got + n);
      net::read_exact(fd, reply.body.data() + got, n, deadline, "receive");
      got += n;
    }
    give_back(fd);
    return reply;
  } catch (const TimeoutError&) {
    ::close(fd);
    TDIST_THROW(TimeoutError, "TCPStore at ", address_, ": no reply to ", what, " within ",
                seconds_text(limit), " s (the server is unresponsive)");
  } catch (const NetworkError& e) {
    ::close(fd);
    TDIST_THROW(NetworkError, "TCPStore at ", address_, ": ", what, " failed: ", e.what());
  } catch (const ProtocolError& e) {
    ::close(fd);
    TDIST_THROW(ProtocolError, "TCPStore at ", address_, ": bad reply to ", what, ": ", e.what());
  } catch (...) {
    ::close(fd);
    throw;
  }
}

}  // namespace tdist::detail
