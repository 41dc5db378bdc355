#include "tdist/comm/transport/channels.h"

#include <sys/random.h>
#include <unistd.h>

#include <climits>
#include <fstream>

#include "tdist/comm/transport/shm/local_link.h"
#include "tdist/comm/transport/shm/shm_channel.h"
#include "tdist/comm/transport/tcp/tcp_channel.h"
#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/process_memory.h"
#include "tdist/core/wire.h"

namespace tdist::comm {
namespace {

constexpr uint32_t kMagic = 0x32534454;  // "TDS2": the offer names a local link, not a segment
constexpr uint32_t kMaxName = 255;
constexpr uint32_t kMaxHost = 255;
constexpr size_t kNonceBytes = 32;

void append_host(Bytes& msg, const std::string& host) {
  wire::Writer w(msg);
  w.u32(static_cast<uint32_t>(host.size()));
  w.raw(host.data(), host.size());
}

std::string read_host(tcp::Connection* conn, int me, int peer,
                      std::chrono::steady_clock::time_point deadline) {
  uint8_t head[4];
  conn->read_all(head, sizeof(head), deadline, "the peer's host key");
  wire::Reader r(head, sizeof(head));
  const uint32_t len = r.u32();
  if (len == 0 || len > kMaxHost) {
    TDIST_THROW(ProtocolError, "rank ", me, ": bad host key length ", len, " from rank ", peer);
  }
  std::string host(len, '\0');
  conn->read_all(host.data(), len, deadline, "the peer's host key");
  return host;
}

Bytes fresh_nonce() {
  Bytes nonce(kNonceBytes);
  size_t got = 0;
  while (got < nonce.size()) {
    const ssize_t n = ::getrandom(nonce.data() + got, nonce.size() - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return nonce;
}

// What both ends of a pair's local link send on it (Note [Shared-memory negotiation]): the
// nonce of the offer and who the link is between.
Bytes link_hello(const Bytes& nonce, int lower, int higher, uint64_t group) {
  Bytes hello(nonce);
  wire::Writer w(hello);
  w.u32(static_cast<uint32_t>(lower));
  w.u32(static_cast<uint32_t>(higher));
  w.u64(group);
  return hello;
}

// The pid of a shared-memory peer whose memory this process may read, else 0. From the
// kernel's word only; our own process never (ranks that are threads of one process, or a link
// that led back to ourselves), so the single-copy path never reads or writes our own memory at
// an address a peer chose.
pid_t readable_pid(const shm::PeerCredentials& peer) {
  if (peer.pid <= 0 || peer.pid == ::getpid() || peer.uid != ::geteuid()) return 0;
  return can_read_process(peer.pid) ? peer.pid : 0;
}

// The lower rank's side of one pair (steps 3 and 5 of the Note).
struct Offer {
  std::unique_ptr<shm::Segment> segment;
  std::unique_ptr<shm::LinkListener> listener;
  Bytes nonce;
  bool sent = false;  // the segment went to the peer
  shm::PeerCredentials peer;
};

// The higher rank's side of one pair (steps 2 and 4).
struct Answer {
  int link = -1;
  uint64_t capacity = 0;
  Bytes hello;
  std::unique_ptr<shm::Segment> segment;
  shm::PeerCredentials peer;
  ~Answer() {
    if (link >= 0) ::close(link);
  }
};

}  // namespace

std::string host_key() {
  if (auto id = env::get("TDIST_HOST_ID")) return *id;
  std::string boot;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot);
  if (boot.empty()) {
    char name[HOST_NAME_MAX + 1] = {};
    ::gethostname(name, sizeof(name) - 1);
    boot = name;
  }
  char ns[64] = {};
  const ssize_t len = ::readlink("/proc/self/ns/net", ns, sizeof(ns) - 1);
  return boot + "/" + (len > 0 ? std::string(ns, static_cast<size_t>(len)) : std::string());
}

Channels make_channels(tcp::Mesh& mesh, int channel, const ChannelOptions& opts,
                       std::chrono::steady_clock::time_point deadline) {
  const int n = mesh.size();
  const int me = mesh.rank();
  TDIST_CHECK_ARG(!opts.host.empty() && opts.host.size() <= kMaxHost,
                  "the host key must have 1 to ", kMaxHost, " bytes, got ", opts.host.size());
  Channels result;
  auto& out = result.peers;
  out.resize(static_cast<size_t>(n));
  result.hosts.resize(static_cast<size_t>(n));
  result.hosts[me] = opts.host;
  result.readable_pids.assign(static_cast<size_t>(n), 0);
  std::vector<Offer> offers(static_cast<size_t>(n));
  std::vector<Answer> answers(static_cast<size_t>(n));
  std::string why;

  // 1. Offers to the higher ranks.
  for (int p = me + 1; p < n; ++p) {
    Offer& o = offers[p];
    if (opts.allow_shm) {
      o.segment = shm::Segment::create(shm::segment_bytes(opts.shm_capacity));
      if (o.segment) o.listener = shm::LinkListener::open(&why);
      if (!o.listener) o.segment.reset();
      if (!o.segment) TDIST_LOG_DEBUG("rank ", me, ": no shared memory to offer rank ", p);
    }
    const std::string name = o.listener ? o.listener->name() : std::string();
    Bytes msg;
    wire::Writer w(msg);
    w.u32(kMagic);
    w.u64(opts.shm_capacity);
    w.u32(static_cast<uint32_t>(name.size()));
    w.raw(name.data(), name.size());
    if (o.listener) {
      o.nonce = fresh_nonce();
      w.raw(o.nonce.data(), o.nonce.size());
    }
    append_host(msg, opts.host);
    mesh.get(channel, p)->write_all(msg.data(), msg.size(), deadline, "the shared-memory offer");
  }
  // 2. Answers to the lower ranks: connect to the offer's local link when it is one we take.
  for (int p = 0; p < me; ++p) {
    auto* conn = mesh.get(channel, p);
    Answer& a = answers[p];
    uint8_t head[16];
    conn->read_all(head, sizeof(head), deadline, "the shared-memory offer");
    wire::Reader r(head, sizeof(head));
    uint32_t magic = r.u32();
    a.capacity = r.u64();
    uint32_t len = r.u32();
    if (magic != kMagic || len > kMaxName || a.capacity < shm::kMinCapacity ||
        a.capacity > shm::kMaxCapacity) {
      TDIST_THROW(ProtocolError, "rank ", me, ": bad shared-memory offer from rank ", p);
    }
    std::string name(len, '\0');
    Bytes nonce(len > 0 ? kNonceBytes : 0);
    if (len > 0) {
      conn->read_all(name.data(), len, deadline, "the shared-memory offer");
      conn->read_all(nonce.data(), nonce.size(), deadline, "the shared-memory offer");
    }
    result.hosts[p] = read_host(conn, me, p, deadline);
    // A ring larger than this rank's own is more memory than it agreed to map (and populate).
    if (len > 0 && opts.allow_shm && result.hosts[p] == opts.host &&
        a.capacity > opts.shm_capacity) {
      TDIST_LOG_DEBUG("rank ", me, ": no shared memory with rank ", p, ": it offers rings of ",
                      a.capacity, " bytes, more than this rank's ", opts.shm_capacity);
    } else if (len > 0 && opts.allow_shm && result.hosts[p] == opts.host) {
      a.hello = link_hello(nonce, p, me, opts.group);
      a.link = shm::connect_link(name, a.hello, &why);
      if (a.link < 0) TDIST_LOG_DEBUG("rank ", me, ": no local link to rank ", p, ": ", why);
    }
    Bytes reply{static_cast<uint8_t>(a.link >= 0 ? 1 : 0)};
    append_host(reply, opts.host);
    conn->write_all(reply.data(), reply.size(), deadline, "the shared-memory answer");
  }
  // 3. The higher ranks' answers: the segment goes to the process that connected with the
  //    hello, when the kernel says it runs as our user.
  for (int p = me + 1; p < n; ++p) {
    auto* conn = mesh.get(channel, p);
    Offer& o = offers[p];
    uint8_t answer = 0;
    conn->read_all(&answer, 1, deadline, "the shared-memory answer");
    result.hosts[p] = read_host(conn, me, p, deadline);
    if (answer == 1 && o.listener) {
      const Bytes hello = link_hello(o.nonce, me, p, opts.group);
      const int link = o.listener->accept_hello(hello, &why);
      if (link >= 0 && shm::peer_credentials(link, &o.peer, &why)) {
        if (o.peer.uid != ::geteuid()) {
          why = str("its process runs as uid ", o.peer.uid);
        } else {
          o.sent = shm::send_with_fd(link, hello, o.segment->fd(), &why);
        }
      }
      if (link >= 0) ::close(link);
      if (!o.sent) TDIST_LOG_DEBUG("rank ", me, ": no shared memory with rank ", p, ": ", why);
    }
    o.listener.reset();
    if (o.segment) o.segment->close_fd();
    const uint8_t sent = o.sent ? 1 : 0;
    conn->write_all(&sent, 1, deadline, "the shared-memory segment");
  }
  // 4. The lower ranks' segments: mapped when the link brought the hello we sent and one
  //    descriptor of the size we agreed to, from a process of our user.
  for (int p = 0; p < me; ++p) {
    auto* conn = mesh.get(channel, p);
    Answer& a = answers[p];
    uint8_t sent = 0;
    conn->read_all(&sent, 1, deadline, "the shared-memory segment");
    if (sent == 1 && a.link >= 0) {
      Bytes hello(a.hello.size());
      const int fd = shm::receive_with_fd(a.link, hello.data(), hello.size(), &why);
      if (fd >= 0) {
        if (hello != a.hello) {
          why = "the local link is not the one rank " + std::to_string(p) + " offered";
        } else if (shm::peer_credentials(a.link, &a.peer, &why)) {
          if (a.peer.uid != ::geteuid()) {
            why = str("its process runs as uid ", a.peer.uid);
          } else {
            a.segment = shm::Segment::map_peer(fd, shm::segment_bytes(a.capacity), &why);
          }
        }
        ::close(fd);
      }
      if (!a.segment) TDIST_LOG_DEBUG("rank ", me, ": no shared memory with rank ", p, ": ", why);
    }
    const uint8_t mapped = a.segment ? 1 : 0;
    conn->write_all(&mapped, 1, deadline, "the shared-memory confirmation");
    if (a.segment) {
      out[p] = std::make_unique<shm::ShmChannel>(std::move(a.segment), a.capacity, false, conn);
      result.readable_pids[p] = readable_pid(a.peer);
    }
  }
  // 5. The higher ranks' confirmations.
  for (int p = me + 1; p < n; ++p) {
    auto* conn = mesh.get(channel, p);
    Offer& o = offers[p];
    uint8_t mapped = 0;
    conn->read_all(&mapped, 1, deadline, "the shared-memory confirmation");
    if (mapped == 1 && o.sent) {
      out[p] =
          std::make_unique<shm::ShmChannel>(std::move(o.segment), opts.shm_capacity, true, conn);
      result.readable_pids[p] = readable_pid(o.peer);
    }
  }
  int shm_peers = 0;
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    if (out[p]) {
      ++shm_peers;
    } else {
      out[p] = std::make_unique<tcp::TcpChannel>(mesh.get(channel, p));
    }
  }
  TDIST_LOG_DEBUG("rank ", me, ": collective channels: ", shm_peers, " shared memory, ",
                  n - 1 - shm_peers, " tcp");
  return result;
}

}  // namespace tdist::comm
