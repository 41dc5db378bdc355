#include "apps/bench/bounds.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <thread>

#include <nlohmann/json.hpp>
#include <openssl/crypto.h>

#include "apps/bench/common.h"
#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/token.h"

namespace tdist::bench {
namespace {

std::runtime_error sys_error(const std::string& what) {
  return std::runtime_error(what + ": " + std::strerror(errno));
}

void set_no_delay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// What time_tcp() sends before each batch: the transfer size, the pattern and how many.
struct BatchHeader {
  uint64_t bytes;
  uint32_t pattern;
  uint32_t count;
};

bool pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return ::pthread_setaffinity_np(::pthread_self(), sizeof(set), &set) == 0;
}

// Two threads, each with a CPU of its own, meet here: meet() returns once both have called it.
class TwoThreadMeeting {
 public:
  void meet() {
    const int round = round_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == 1) {
      arrived_.store(0, std::memory_order_relaxed);
      round_.store(round + 1, std::memory_order_release);
    } else {
      while (round_.load(std::memory_order_acquire) == round) {}
    }
  }

 private:
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<int> round_{0};
};

// How many copies of `bytes` one timed sample makes so that it moves at least `sample_bytes`.
size_t copies_per_sample(size_t bytes, size_t sample_bytes) {
  return bytes == 0 ? 1 : std::max<size_t>(1, (sample_bytes + bytes - 1) / bytes);
}

}  // namespace

std::vector<double> time_memcpy(size_t bytes, int warmup, int iters) {
  const size_t copies = copies_per_sample(bytes, size_t{256} << 10);
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  std::vector<double> seconds = time_calls(warmup, iters, [&](int i) {
    for (size_t c = 0; c < copies; ++c) {
      if (bytes > 0) src[0] = static_cast<char>(i + c);  // each copy differs: none can be elided
      std::memcpy(dst.data(), src.data(), bytes);
      asm volatile("" : : "r"(dst.data()) : "memory");  // the copy is used: it stays
    }
  });
  for (double& s : seconds) s /= static_cast<double>(copies);
  return seconds;
}

std::optional<std::vector<double>> time_cross_core_copy(size_t bytes, int samples) {
  const std::vector<int> cpus = env::allowed_cpus();
  if (cpus.size() < 2 || samples < 1) return std::nullopt;
  constexpr int kWarmup = 2;
  // As in time_memcpy, a sample of small copies times several (distinct buffers, each written
  // by the other core), so that the clock's own cost stays small beside them.
  const size_t copies = copies_per_sample(bytes, size_t{64} << 10);
  const size_t total = bytes * copies;
  std::vector<char> own[2] = {std::vector<char>(total), std::vector<char>(total)};
  std::vector<char> copy[2] = {std::vector<char>(total), std::vector<char>(total)};
  std::atomic<int> pinned{0}, failed{0};
  TwoThreadMeeting meeting;
  std::vector<double> seconds;
  auto body = [&](int me) {
    if (!pin(cpus[me])) failed.fetch_add(1);
    pinned.fetch_add(1);
    while (pinned.load() < 2) {}
    if (failed.load() != 0) return;
    for (int i = 0; i < kWarmup + samples; ++i) {
      std::memset(own[me].data(), i + me, total);  // modified lines in this core's caches
      meeting.meet();
      const auto start = std::chrono::steady_clock::now();
      for (size_t c = 0; c < copies; ++c)
        std::memcpy(copy[me].data() + c * bytes, own[1 - me].data() + c * bytes, bytes);
      asm volatile("" : : "r"(copy[me].data()) : "memory");  // the copies are used: they stay
      const auto end = std::chrono::steady_clock::now();
      if (me == 0 && i >= kWarmup)
        seconds.push_back(std::chrono::duration<double>(end - start).count() /
                          static_cast<double>(copies));
      meeting.meet();
    }
  };
  std::thread other(body, 1);
  std::thread timed(body, 0);
  other.join();
  timed.join();
  if (failed.load() != 0) return std::nullopt;
  return seconds;
}

std::optional<CoreRoundTrip> core_round_trip(int trips, int runs) {
  const std::vector<int> cpus = env::allowed_cpus();
  if (cpus.size() < 2 || trips < 1 || runs < 1) return std::nullopt;
  struct alignas(64) Line {
    std::atomic<long> v{0};
  };
  std::vector<double> ns;
  for (int run = 0; run < runs; ++run) {
    Line ping, pong;
    std::atomic<int> pinned{0};  // 1: the echo thread is pinned; -1: it could not be
    std::thread echo([&] {
      if (!pin(cpus[1])) {
        pinned = -1;
        return;
      }
      pinned = 1;
      for (long i = 1; i <= trips; ++i) {
        while (ping.v.load(std::memory_order_acquire) < i) {}
        pong.v.store(i, std::memory_order_release);
      }
    });
    bool ok = false;
    double took = 0;  // ns per round trip
    std::thread timer([&] {
      while (pinned.load() == 0) std::this_thread::yield();
      if (pinned.load() < 0 || !pin(cpus[0])) {
        ping.v.store(trips, std::memory_order_release);  // lets the echo thread run out
        return;
      }
      // At most about kMaxRun per run: on a busy host each hand-off may wait for a time slice.
      constexpr auto kMaxRun = std::chrono::milliseconds(100);
      const auto start = std::chrono::steady_clock::now();
      long done = 0;
      while (done < trips) {
        ++done;
        ping.v.store(done, std::memory_order_release);
        while (pong.v.load(std::memory_order_acquire) != done) {}
        if (done % 64 == 0 && std::chrono::steady_clock::now() - start > kMaxRun) break;
      }
      took = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start)
                 .count() /
             done;
      ping.v.store(trips, std::memory_order_release);  // lets the echo thread run out
      ok = true;
    });
    timer.join();
    echo.join();
    if (!ok) return std::nullopt;
    ns.push_back(took);
  }
  std::sort(ns.begin(), ns.end());
  return CoreRoundTrip{cpus[0], cpus[1], ns[ns.size() / 2]};
}

std::string RoundTrips::describe(const std::string& what) const {
  if (!before || !after)
    return "core-to-core round trip: not measured (fewer than two CPUs to run on)";
  char text[256];
  std::snprintf(
      text, sizeof(text),
      "core-to-core round trip of a cache line (CPUs %d and %d): %.0f ns before %s, %.0f ns after",
      before->cpu_a, before->cpu_b, before->ns, what.c_str(), after->ns);
  const double ratio = after->ns / before->ns;
  if (ratio > 1.5 || ratio < 1 / 1.5) {
    return std::string(text) +
           " (it changed during them, and the figures may have changed with it)";
  }
  return text;
}

nlohmann::json RoundTrips::json() const {
  if (!before || !after) return nullptr;
  return {
      {"cpus", {before->cpu_a, before->cpu_b}}, {"before_ns", before->ns}, {"after_ns", after->ns}};
}

TcpLink::~TcpLink() {
  if (fd_ >= 0) ::close(fd_);
}

TcpLink TcpLink::connect(const std::string& host, int port, const std::string& key,
                         double timeout_s) {
  const auto deadline = net::Clock::now() + std::chrono::duration_cast<net::Clock::duration>(
                                                std::chrono::duration<double>(timeout_s));
  const int fd = net::connect_to(host, static_cast<uint16_t>(port), deadline, "the bound's peer");
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL, 0) & ~O_NONBLOCK);  // send_all/recv_all block
  set_no_delay(fd);
  TcpLink link(fd);
  link.send_all(key.data(), key.size());
  return link;
}

void TcpLink::send_all(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd_, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) throw sys_error("send");
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void TcpLink::recv_all(void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t k = ::recv(fd_, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) throw sys_error("recv");
    if (k == 0) throw std::runtime_error("recv: the peer closed the connection");
    p += k;
    n -= static_cast<size_t>(k);
  }
}

TcpListener::TcpListener(const std::string& host) : listener_(host, 0, 4), key_(random_hex(16)) {}

TcpLink TcpListener::accept() {
  for (;;) {
    TcpLink link(listener_.accept(net::kNoDeadline));
    ::timeval wait{1, 0};  // a peer that connects but says nothing holds the port this long
    ::setsockopt(link.fd_, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof(wait));
    std::string got(key_.size(), '\0');
    const bool ok = [&] {
      try {
        link.recv_all(got.data(), got.size());
      } catch (const std::runtime_error&) {
        return false;
      }
      return CRYPTO_memcmp(got.data(), key_.data(), key_.size()) == 0;
    }();
    if (!ok) {
      TDIST_LOG_WARN("tdist-bench: closed a connection to the bound's port ", port(),
                     " that did not present its key");
      continue;
    }
    ::timeval none{0, 0};
    ::setsockopt(link.fd_, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof(none));
    set_no_delay(link.fd_);
    return link;
  }
}

std::vector<double> time_tcp(TcpLink& link, TcpPattern pattern, size_t bytes, int warmup,
                             int iters) {
  const BatchHeader h{bytes, static_cast<uint32_t>(pattern), static_cast<uint32_t>(warmup + iters)};
  link.send_all(&h, sizeof(h));
  std::vector<char> buf(bytes > 0 ? bytes : 1, 1);
  char ack = 0;
  return time_calls(warmup, iters, [&](int) {
    link.send_all(buf.data(), bytes);
    if (pattern == TcpPattern::kPingPong) {
      link.recv_all(buf.data(), bytes);
    } else {
      link.recv_all(&ack, 1);
    }
  });
}

void serve_tcp_bounds(TcpLink& link, size_t max_bytes) {
  std::vector<char> buf;
  for (;;) {
    BatchHeader h{};
    try {
      link.recv_all(&h, sizeof(h));
    } catch (const std::runtime_error&) {
      return;  // the measuring end closed the link: done
    }
    TDIST_CHECK_ARG(h.bytes <= max_bytes, "tdist-bench: the bound's peer asked for transfers of ",
                    h.bytes, " bytes; this benchmark measures at most ", max_bytes);
    buf.resize(h.bytes > 0 ? h.bytes : 1);
    const char ack = 1;
    for (uint32_t i = 0; i < h.count; ++i) {
      link.recv_all(buf.data(), h.bytes);
      if (h.pattern == static_cast<uint32_t>(TcpPattern::kPingPong)) {
        link.send_all(buf.data(), h.bytes);
      } else {
        link.send_all(&ack, 1);
      }
    }
  }
}

}  // namespace tdist::bench
