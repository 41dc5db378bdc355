#include "tdist/comm/transport/channels.h"

#include <unistd.h>

#include <climits>
#include <fstream>
#include <random>

#include "tdist/comm/transport/shm/shm_channel.h"
#include "tdist/comm/transport/tcp/tcp_channel.h"
#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/process_memory.h"
#include "tdist/core/wire.h"

namespace tdist::comm {
namespace {

constexpr uint32_t kMagic = 0x48534454;  // "TDSH"
constexpr uint32_t kMaxName = 255;
constexpr uint32_t kMaxHost = 255;

std::string fresh_name(int lower, int higher) {
  std::random_device rd;
  uint64_t r = (uint64_t(rd()) << 32) ^ rd();
  return str("/tdist-", ::getpid(), "-", lower, "-", higher, "-", std::hex, r);
}

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

// This process's pid and canary (Note [Single-copy collectives] in comm/algorithms/algorithms.h).
void append_memory(Bytes& msg) {
  const ProcessCanary canary = process_canary();
  wire::Writer w(msg);
  w.u32(static_cast<uint32_t>(::getpid()));
  w.u64(canary.address);
  w.u64(canary.value);
}

// What append_memory() sent.
struct PeerProcess {
  pid_t pid = 0;
  ProcessCanary canary{};
  // The pid when this process can read the peer's memory (checked on its canary), else 0.
  // Called for shared-memory peers only: another host's pid names nobody here.
  pid_t readable_pid() const { return can_read_process(pid, canary) ? pid : 0; }
};

PeerProcess read_memory(tcp::Connection* conn, std::chrono::steady_clock::time_point deadline) {
  uint8_t fields[4 + 8 + 8];
  conn->read_all(fields, sizeof(fields), deadline, "the peer's process");
  wire::Reader r(fields, sizeof(fields));
  PeerProcess peer;
  peer.pid = static_cast<pid_t>(r.u32());
  peer.canary.address = r.u64();
  peer.canary.value = r.u64();
  return peer;
}

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
  TDIST_CHECK_ARG(!opts.host.empty() && opts.host.size() <= kMaxHost, "the host key must have 1 to ",
                  kMaxHost, " bytes, got ", opts.host.size());
  Channels result;
  auto& out = result.peers;
  out.resize(static_cast<size_t>(n));
  result.hosts.resize(static_cast<size_t>(n));
  result.hosts[me] = opts.host;
  result.readable_pids.assign(static_cast<size_t>(n), 0);
  std::vector<std::unique_ptr<shm::Segment>> segments(static_cast<size_t>(n));
  std::vector<std::string> names(static_cast<size_t>(n));
  const size_t bytes = shm::segment_bytes(opts.shm_capacity);
  // Whatever happens, no segment name outlives the negotiation.
  struct Unlinker {
    std::vector<std::string>& names;
    ~Unlinker() {
      for (auto& name : names) {
        if (!name.empty()) shm::Segment::unlink(name);
      }
    }
  } unlinker{names};
  if (opts.allow_shm) shm::Segment::sweep_dead();

  // 1. Offers to the higher ranks.
  for (int p = me + 1; p < n; ++p) {
    if (opts.allow_shm) {
      names[p] = fresh_name(me, p);
      segments[p] = shm::Segment::create(names[p], bytes);
      if (!segments[p]) names[p].clear();
    }
    Bytes msg;
    wire::Writer w(msg);
    w.u32(kMagic);
    w.u64(opts.shm_capacity);
    w.u32(static_cast<uint32_t>(names[p].size()));
    w.raw(names[p].data(), names[p].size());
    append_host(msg, opts.host);
    append_memory(msg);
    mesh.get(channel, p)->write_all(msg.data(), msg.size(), deadline, "the shared-memory offer");
  }
  // 2. Answers to the lower ranks.
  for (int p = 0; p < me; ++p) {
    auto* conn = mesh.get(channel, p);
    uint8_t head[16];
    conn->read_all(head, sizeof(head), deadline, "the shared-memory offer");
    wire::Reader r(head, sizeof(head));
    uint32_t magic = r.u32();
    uint64_t capacity = r.u64();
    uint32_t len = r.u32();
    if (magic != kMagic || len > kMaxName || capacity < shm::kMinCapacity ||
        capacity > shm::kMaxCapacity) {
      TDIST_THROW(ProtocolError, "rank ", me, ": bad shared-memory offer from rank ", p);
    }
    std::string name(len, '\0');
    if (len > 0) conn->read_all(name.data(), len, deadline, "the shared-memory offer");
    result.hosts[p] = read_host(conn, me, p, deadline);
    const PeerProcess process = read_memory(conn, deadline);
    std::unique_ptr<shm::Segment> seg;
    if (len > 0 && opts.allow_shm && result.hosts[p] == opts.host) {
      seg = shm::Segment::open(name, shm::segment_bytes(capacity));
    }
    Bytes reply{static_cast<uint8_t>(seg ? 1 : 0)};
    append_host(reply, opts.host);
    append_memory(reply);
    conn->write_all(reply.data(), reply.size(), deadline, "the shared-memory answer");
    if (seg) {
      out[p] = std::make_unique<shm::ShmChannel>(std::move(seg), capacity, false, conn);
      result.readable_pids[p] = process.readable_pid();
    }
  }
  // 3. The higher ranks' answers.
  for (int p = me + 1; p < n; ++p) {
    auto* conn = mesh.get(channel, p);
    uint8_t answer = 0;
    conn->read_all(&answer, 1, deadline, "the shared-memory answer");
    result.hosts[p] = read_host(conn, me, p, deadline);
    const PeerProcess process = read_memory(conn, deadline);
    if (!names[p].empty()) shm::Segment::unlink(names[p]);
    names[p].clear();
    if (answer == 1 && segments[p]) {
      out[p] = std::make_unique<shm::ShmChannel>(std::move(segments[p]), opts.shm_capacity, true,
                                                 conn);
      result.readable_pids[p] = process.readable_pid();
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
