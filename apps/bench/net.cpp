// tdist-bench net: the I/O models a socket stack can be built on, timed on the traffic of each of
// tdist's three stacks, in one run on this machine.
//
// Note [I/O model measurement]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Models (each side of a connection uses the same one):
//   posix        blocking send/recv on the thread that needs the bytes (the mesh's steady state:
//                a rank's own thread drives its connections; RPC's thread per connection)
//   poll         non-blocking sockets: send/recv until EAGAIN, then poll() for readiness (the
//                mesh's hello loop, tdist's deadline reads and writes)
//   asio         Boost.Asio with one io_context thread that runs every handler; the thread that
//                needs the bytes posts the operation to it and waits for its completion (how a
//                reactor-based mesh or RPC with one I/O thread would be built)
//   asio-inline  Boost.Asio where the thread that needs the bytes runs the io_context itself
//                (no hand-off; only possible when one thread owns the connection)
// Shapes (loopback, TCP_NODELAY, threads of this process):
//   pingpong     --small bytes one way, the same back: a collective's small step, an RPC call
//   stream       --large bytes each way per round: a collective's large step (GB/s both ways)
//   requests     --clients connections to one server, each sending 64-byte requests that get a
//                64-byte reply: the store's traffic. Clients are blocking threads; what varies
//                is the server: posix = a thread per connection, poll = one poll() loop over
//                all of them, asio = one io_context thread (the TCPStore server's model),
//                asio-inline = asio (a server has no waiting caller to run it).
// Each round runs every model once, in turn; the table shows the median of the rounds.
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <boost/asio.hpp>
#include <nlohmann/json.hpp>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

#include "apps/bench/bounds.h"
#include "apps/bench/common.h"
#include "apps/bench/subcommands.h"
#include "tdist/core/error.h"
#include "tdist/core/net/address.h"

namespace tdist::bench {
namespace net_bench {  // see collective.cpp
namespace {

namespace asio = boost::asio;
using json = nlohmann::json;

constexpr size_t kRequestBytes = 64;
const char* const kModels[] = {"posix", "poll", "asio", "asio-inline"};

struct Options {
  std::string small_text = "4K", large_text = "16M";
  size_t small = 0, large = 0;  // parsed from the texts
  int iters = 2000;
  int large_iters = 20;
  int clients = 8;
  int requests = 2000;  // per client
  int rounds = 3;
  std::string json_file;
};

std::runtime_error sys_error(const std::string& what) {
  return std::runtime_error(what + ": " + std::strerror(errno));
}

void set_blocking(int fd, bool blocking) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, blocking ? flags & ~O_NONBLOCK : flags | O_NONBLOCK);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// `n` connected loopback sockets to one listener: {client, server} each.
std::vector<std::pair<int, int>> connected_pairs(int n) {
  net::Listener listener("127.0.0.1", 0, n);
  const auto deadline = net::Clock::now() + std::chrono::seconds(10);
  std::vector<std::pair<int, int>> pairs;
  for (int i = 0; i < n; ++i) {
    const int c = net::connect_once("127.0.0.1", listener.port(), deadline, "the bench's peer");
    const int s = listener.accept(deadline);
    if (s < 0) throw std::runtime_error("accept timed out");
    pairs.emplace_back(c, s);
  }
  return pairs;
}

// One side of a connection, moving whole messages the way its model does. Owns the descriptor.
class Endpoint {
 public:
  virtual ~Endpoint() = default;
  virtual void send(const void* data, size_t n) = 0;
  virtual void recv(void* data, size_t n) = 0;
};

// Blocking calls: bounds.h's TcpLink, the plain TCP the other benchmarks measure their bound with.
class PosixEndpoint : public Endpoint {
 public:
  explicit PosixEndpoint(int fd) : link_((set_blocking(fd, true), fd)) {}
  void send(const void* data, size_t n) override { link_.send_all(data, n); }
  void recv(void* data, size_t n) override { link_.recv_all(data, n); }

 private:
  TcpLink link_;
};

class PollEndpoint : public Endpoint {
 public:
  explicit PollEndpoint(int fd) : fd_(fd) { set_blocking(fd_, false); }
  ~PollEndpoint() override { ::close(fd_); }
  void send(const void* data, size_t n) override {
    const auto* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t k = ::send(fd_, p, n, MSG_NOSIGNAL);
      if (k > 0) {
        p += k;
        n -= static_cast<size_t>(k);
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wait(POLLOUT);
      } else if (errno != EINTR) {
        throw sys_error("send");
      }
    }
  }
  void recv(void* data, size_t n) override {
    auto* p = static_cast<char*>(data);
    while (n > 0) {
      const ssize_t k = ::recv(fd_, p, n, 0);
      if (k > 0) {
        p += k;
        n -= static_cast<size_t>(k);
      } else if (k == 0) {
        throw std::runtime_error("recv: the peer closed the connection");
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wait(POLLIN);
      } else if (errno != EINTR) {
        throw sys_error("recv");
      }
    }
  }

 private:
  void wait(short events) {
    pollfd p{fd_, events, 0};
    while (::poll(&p, 1, -1) < 0) {
      if (errno != EINTR) throw sys_error("poll");
    }
  }
  int fd_;
};

// Boost.Asio over one socket. `hop`: a thread of its own runs the io_context and the caller waits
// for each operation's completion; otherwise the caller runs the io_context until its operation
// completes.
class AsioEndpoint : public Endpoint {
 public:
  AsioEndpoint(int fd, bool hop) : socket_(io_), hop_(hop) {
    set_blocking(fd, false);
    socket_.assign(asio::ip::tcp::v4(), fd);
    if (hop_) {
      guard_.emplace(io_.get_executor());
      thread_ = std::thread([this] { io_.run(); });
    }
  }
  ~AsioEndpoint() override {
    if (hop_) {
      guard_.reset();
      io_.stop();
      thread_.join();
    }
  }
  void send(const void* data, size_t n) override {
    run([&](auto done) { asio::async_write(socket_, asio::buffer(data, n), done); });
  }
  void recv(void* data, size_t n) override {
    run([&](auto done) { asio::async_read(socket_, asio::buffer(data, n), done); });
  }

 private:
  // Starts an operation with start(handler) and returns once the handler ran.
  template <class Start>
  void run(Start&& start) {
    boost::system::error_code result;
    if (!hop_) {
      start([&](const boost::system::error_code& ec, size_t) { result = ec; });
      io_.restart();
      io_.run();
    } else {
      std::promise<void> finished;
      asio::post(io_, [&] {
        start([&](const boost::system::error_code& ec, size_t) {
          result = ec;
          finished.set_value();
        });
      });
      finished.get_future().wait();
    }
    if (result) throw std::runtime_error("asio: " + result.message());
  }

  asio::io_context io_;
  asio::ip::tcp::socket socket_;
  bool hop_;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> guard_;
  std::thread thread_;
};

std::unique_ptr<Endpoint> make_endpoint(const std::string& model, int fd) {
  if (model == "posix") return std::make_unique<PosixEndpoint>(fd);
  if (model == "poll") return std::make_unique<PollEndpoint>(fd);
  return std::make_unique<AsioEndpoint>(fd, model == "asio");
}

// Median seconds of one round trip of `bytes` each way through `model` on both sides.
double time_round_trip(const std::string& model, size_t bytes, int warmup, int iters) {
  const auto pair = connected_pairs(1).front();
  auto client = make_endpoint(model, pair.first);
  auto echo = make_endpoint(model, pair.second);
  std::thread server([&echo, bytes, n = warmup + iters] {
    std::vector<char> buf(bytes);
    for (int i = 0; i < n; ++i) {
      echo->recv(buf.data(), bytes);
      echo->send(buf.data(), bytes);
    }
  });
  std::vector<char> out(bytes, 1), in(bytes);
  std::vector<double> s;
  try {
    s = time_calls(warmup, iters, [&](int) {
      client->send(out.data(), bytes);
      client->recv(in.data(), bytes);
    });
  } catch (...) {
    client.reset();  // the server's next read fails, and it ends
    server.join();
    throw;
  }
  server.join();
  return median(s);
}

// The store's shape: `clients` blocking clients, one server of `model`; requests per second.
class RequestServer {
 public:
  RequestServer(const std::string& model, std::vector<int> fds)
      : model_(model), fds_(std::move(fds)) {}

  // Serves every connection until its client closes it.
  void serve() {
    if (model_ == "posix") {
      std::vector<std::thread> threads;
      for (int fd : fds_) threads.emplace_back([fd] { serve_blocking(fd); });
      for (auto& t : threads) t.join();
    } else if (model_ == "poll") {
      serve_poll();
    } else {
      serve_asio();
    }
  }

 private:
  static void serve_blocking(int fd) {
    PosixEndpoint ep(fd);
    char buf[kRequestBytes];
    try {
      for (;;) {
        ep.recv(buf, sizeof(buf));
        ep.send(buf, sizeof(buf));
      }
    } catch (const std::exception&) {
      // the client closed its connection: done
    }
  }

  void serve_poll() {
    struct Conn {
      char buf[kRequestBytes];
      size_t got = 0, sent = 0;
      bool replying = false;
    };
    std::vector<pollfd> pfds;
    for (int fd : fds_) {
      set_blocking(fd, false);
      pfds.push_back({fd, POLLIN, 0});
    }
    std::vector<Conn> conns(fds_.size());
    size_t open = fds_.size();
    auto drop = [&](size_t i) {  // the client closed its connection, or it failed
      ::close(pfds[i].fd);
      pfds[i].fd = -1;
      --open;
    };
    while (open > 0) {
      if (::poll(pfds.data(), pfds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        throw sys_error("poll");
      }
      for (size_t i = 0; i < pfds.size(); ++i) {
        if (pfds[i].fd < 0 || pfds[i].revents == 0) continue;
        Conn& c = conns[i];
        const int fd = pfds[i].fd;
        if (!c.replying) {
          const ssize_t k = ::recv(fd, c.buf + c.got, kRequestBytes - c.got, 0);
          if (k == 0 || (k < 0 && errno != EAGAIN && errno != EINTR)) {
            drop(i);
            continue;
          }
          if (k > 0) c.got += static_cast<size_t>(k);
          if (c.got < kRequestBytes) continue;
          c.replying = true;
          c.sent = 0;
        }
        const ssize_t k = ::send(fd, c.buf + c.sent, kRequestBytes - c.sent, MSG_NOSIGNAL);
        if (k < 0 && errno != EAGAIN && errno != EINTR) {
          drop(i);
          continue;
        }
        if (k > 0) c.sent += static_cast<size_t>(k);
        if (c.sent == kRequestBytes) {
          c.replying = false;
          c.got = 0;
          pfds[i].events = POLLIN;
        } else {
          pfds[i].events = POLLOUT;
        }
      }
    }
  }

  struct Session : std::enable_shared_from_this<Session> {
    explicit Session(asio::ip::tcp::socket s) : socket(std::move(s)) {}
    void read() {
      asio::async_read(socket, asio::buffer(buf),
                       [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                         if (!ec) self->write();
                       });
    }
    void write() {
      asio::async_write(socket, asio::buffer(buf),
                        [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                          if (!ec) self->read();
                        });
    }
    asio::ip::tcp::socket socket;
    std::array<char, kRequestBytes> buf{};
  };

  void serve_asio() {
    asio::io_context io;
    for (int fd : fds_) {
      set_blocking(fd, false);
      asio::ip::tcp::socket s(io);
      s.assign(asio::ip::tcp::v4(), fd);
      std::make_shared<Session>(std::move(s))->read();
    }
    io.run();  // returns when every session has ended
  }

  std::string model_;
  std::vector<int> fds_;
};

double requests_per_second(const std::string& model, int clients, int requests) {
  const auto pairs = connected_pairs(clients);
  std::vector<int> server_fds;
  for (const auto& p : pairs) server_fds.push_back(p.second);
  RequestServer server(model, server_fds);
  std::thread server_thread([&server] { server.serve(); });
  std::vector<std::thread> threads;
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& p : pairs) {
    threads.emplace_back([fd = p.first, requests] {
      PosixEndpoint ep(fd);  // closed at the end: the server sees EOF
      char buf[kRequestBytes] = {};
      for (int i = 0; i < requests; ++i) {
        buf[0] = static_cast<char>(i);
        ep.send(buf, sizeof(buf));
        ep.recv(buf, sizeof(buf));
      }
    });
  }
  for (auto& t : threads) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  server_thread.join();
  return static_cast<double>(clients) * requests / s;
}

json measure_round(const Options& o) {
  json r;
  for (const char* m : kModels) {
    r[m]["pingpong_us"] = time_round_trip(m, o.small, o.iters / 10, o.iters) * 1e6;
    r[m]["stream_gbps"] =
        2.0 * static_cast<double>(o.large) / time_round_trip(m, o.large, 2, o.large_iters) / 1e9;
    r[m]["requests_per_s"] =
        requests_per_second(m == std::string("asio-inline") ? "asio" : m, o.clients, o.requests);
  }
  return r;
}

}  // namespace
}  // namespace net_bench

int run_net_bench(int argc, char** argv) {
  using namespace net_bench;
  Options o;
  CLI::App app{
      "tdist-bench net: POSIX, poll and Boost.Asio I/O on the traffic of the mesh, RPC "
      "and the store (loopback, threads of this process)"};
  app.add_option("--small", o.small_text,
                 "ping-pong message bytes, K/M/G suffixes (a small collective, an RPC call)")
      ->capture_default_str();
  app.add_option("--large", o.large_text,
                 "stream message bytes each way, K/M/G suffixes (a large collective step)")
      ->capture_default_str();
  app.add_option("--iters", o.iters, "ping-pongs timed per model")->check(CLI::Range(1, 1 << 24));
  app.add_option("--large-iters", o.large_iters, "stream rounds timed per model")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--clients", o.clients, "connections of the request shape")
      ->check(CLI::Range(1, 512));
  app.add_option("--requests", o.requests, "requests per client")->check(CLI::Range(1, 1 << 24));
  app.add_option("--rounds", o.rounds, "rounds, each running every model in turn (median)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--json", o.json_file, "also write the results as JSON to this file");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return run_or_report("tdist-bench net", [&] {
    o.small = parse_bytes(o.small_text);
    o.large = parse_bytes(o.large_text);
    for (size_t b : {o.small, o.large}) {
      TDIST_CHECK_ARG(b >= 1 && b <= (size_t{1} << 30),
                      "--small and --large take 1 byte to 1G, not ", b, " bytes");
    }
    std::vector<json> rounds;
    for (int i = 0; i < o.rounds; ++i) rounds.push_back(measure_round(o));
    json result{{"small_bytes", o.small},
                {"large_bytes", o.large},
                {"clients", o.clients},
                {"rounds", o.rounds}};
    struct Row {
      const char* key;
      const char* label;
    };
    const Row rows[] = {{"pingpong_us", "pingpong round trip (us)"},
                        {"stream_gbps", "stream, both ways (GB/s)"},
                        {"requests_per_s", "requests/s, one server"}};
    std::printf("%-26s", "shape");
    for (const char* m : kModels) std::printf(" %12s", m);
    std::printf("\n");
    for (const Row& row : rows) {
      std::printf("%-26s", row.label);
      for (const char* m : kModels) {
        std::vector<double> v;
        for (const json& r : rounds) v.push_back(r[m][row.key].get<double>());
        const double med = median(v);
        result["models"][m][row.key] = med;
        std::printf(" %12.*f", row.key == std::string("requests_per_s") ? 0 : 2, med);
      }
      std::printf("\n");
    }
    std::printf(
        "(%zu-byte ping-pong, %zu-byte stream, %d clients x %d requests of %zu bytes; "
        "medians of %d rounds; asio-inline's server is asio's)\n",
        o.small, o.large, o.clients, o.requests, kRequestBytes, o.rounds);
    if (!o.json_file.empty()) {
      std::ofstream f(o.json_file);
      f << result.dump(2) << "\n";
      if (!f) throw std::runtime_error("cannot write " + o.json_file);
    }
    return 0;
  });
}

}  // namespace tdist::bench
