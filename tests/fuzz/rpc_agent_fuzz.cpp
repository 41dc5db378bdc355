// Fuzzes two running RPC workers through a socket, as a peer that passed the handshake would: the
// RRef protocol and the calls behind the ids the decoders accept (rpc/detail/rref_context.h,
// rpc/detail/request_handler.cpp, rpc/detail/dispatcher.cpp, pending_calls.cpp), which the rpc_message
// target does not reach. Workers p0 and p1 (ranks 0 and 1 of 2, threads of this process, one in-process
// TCPStore) run for the whole campaign. Each input is a stream of RPC frames sent to p0 on a
// fresh connection that authenticated as rank 1 (so p0 takes it for p1: its RRef messages act on
// p1's forks, and what p0 sends p1 in turn reaches the real p1), then half-closed; p0's replies
// are read until it closes the connection or 100 ms pass. Every 64 inputs and at the end, the
// real p1 must still be served by p0: a call, an RRef created, fetched, called and dropped. A
// worker that crashes, wedges or trips a sanitizer is a finding, as is memory the inputs do not
// pay for (run.sh's RSS limit).
//
// Input: byte 0 selects the sender. Even: this process, without the same-host fast path (p0
// refuses tensor addresses from it; it would never trust its own process anyway). Odd: a child
// process forked before the workers started, which asks for the fast path with its own pid, so
// p0 reads the tensors whose addresses the frames give straight from the child's memory
// (process_vm_readv): the child maps 64 KiB at kChildBuffer, where the seeds' addresses point,
// and anything else is what the kernel says it is. The rest of the input is the frames.
//
// TDIST_FUZZ_WRITE_SEEDS=<dir> fuzz_rpc_agent writes the seed corpus (frame sequences: a call, an
// RRef's whole life, forks, stray responses and errors) into <dir> and exits.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>

#include <ATen/ops/add.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sum.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tdist/core/logging.h"
#include "tdist/core/tcp_store.h"
#include "tdist/rpc/agent.h"
#include "tdist/rpc/detail/auth.h"
#include "tdist/rpc/rref.h"
#include "tests/fuzz/fuzz_files.h"
#include "tests/fuzz/fuzz_socket.h"
#include "tests/fuzz/rpc_frames.h"

namespace {

namespace rpc = tdist::rpc;
namespace detail = tdist::rpc::detail;
using detail::MessageType;

// Registered functions get the inputs' numbers: they wrap instead of overflowing.
int64_t wrapping_add(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}

struct Counter {
  int64_t value = 0;
  explicit Counter(int64_t v = 0) : value(v) {}
  int64_t add(int64_t d) { return value = wrapping_add(value, d); }
  at::Tensor scaled(at::Tensor t) { return t.mul(static_cast<double>(value)); }
  template <class Archive>
  void serialize(Archive& ar) {  // to_here() copies it
    ar(value);
  }
};

void register_functions() {
  rpc::register_function("add", [](int64_t a, int64_t b) { return wrapping_add(a, b); });
  rpc::register_function("sum", [](at::Tensor t, std::vector<at::Tensor> ts) {
    for (const auto& x : ts) t = t.add(x.sum());
    return t;
  });
  // Takes an RRef: loading it runs the RRef protocol (a fork of a value p1 or p0 owns).
  rpc::register_function("peek", [](rpc::RRef<Counter> r) { return int64_t{r.owner()}; });
  rpc::register_class<Counter>("Counter")
      .constructor<int64_t>()
      .method("add", &Counter::add)
      .method("scaled", &Counter::scaled);
}

tdist::TCPStoreServer* g_server = nullptr;
std::shared_ptr<rpc::RpcAgent> g_p0, g_p1;

// One input's frames on a fresh connection that authenticated as rank 1; then its replies.
void send_input(uint16_t port, bool fast_path, const uint8_t* data, size_t size) {
  const int fd = tdist::fuzz::connect_loopback(port, "p0");
  detail::HandshakeOptions ho;
  ho.my_rank = 1;
  ho.world_size = 2;
  ho.fast_path = fast_path;
  ho.timeout = tdist::Millis(10000);
  try {
    detail::client_handshake(fd, ho, 0);
  } catch (const tdist::Error& e) {
    std::fprintf(stderr, "p0 refused an honest handshake: %s\n", e.what());
    std::abort();
  }
  tdist::fuzz::send_and_drain(fd, data, size);
}

// The same-host peer: a child process that sends the inputs it is handed on its own connections
// with the fast path on. Messages on the socket pair: p0's port (2 bytes) first, then one input
// each, each answered with one byte once its connection is done.
constexpr uintptr_t kChildBuffer = 0x7f0000001000;
constexpr size_t kChildBufferBytes = 64 << 10;
constexpr size_t kMaxInput = 64 << 10;  // within a socket pair's default buffer
int g_child = -1;                       // the parent's end of the socket pair

[[noreturn]] void child_main(int sock) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  void* buffer =
      ::mmap(reinterpret_cast<void*>(kChildBuffer), kChildBufferBytes, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  if (buffer != MAP_FAILED) {
    for (size_t i = 0; i < kChildBufferBytes; ++i)
      static_cast<uint8_t*>(buffer)[i] = uint8_t(i * 7);
  }
  uint16_t port = 0;
  if (::recv(sock, &port, sizeof(port), 0) != sizeof(port)) ::_exit(0);
  std::vector<uint8_t> input(kMaxInput);
  for (;;) {
    const ssize_t n = ::recv(sock, input.data(), input.size(), 0);
    if (n <= 0) ::_exit(0);  // the fuzzer is gone (every input comes with a leading byte)
    send_input(port, true, input.data() + 1, static_cast<size_t>(n) - 1);
    const uint8_t done = 1;
    if (::send(sock, &done, 1, MSG_NOSIGNAL) != 1) ::_exit(0);
  }
}

void start_child() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) != 0) std::abort();
  const int buffer = static_cast<int>(2 * kMaxInput);
  for (int fd : sv) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer, sizeof(buffer));
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer, sizeof(buffer));
  }
  const pid_t pid = ::fork();
  if (pid < 0) std::abort();
  if (pid == 0) {
    ::close(sv[0]);
    child_main(sv[1]);
  }
  ::close(sv[1]);
  g_child = sv[0];
}

void send_from_child(const uint8_t* data, size_t size) {
  // A leading byte: an empty input would be a packet of length 0, which the child's recv could
  // not tell from the end of the stream (it exited, and the next input found it dead).
  size = std::min(size, kMaxInput - 1);
  std::vector<uint8_t> packet(size + 1, 0);
  if (size > 0) std::memcpy(packet.data() + 1, data, size);
  if (::send(g_child, packet.data(), packet.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(packet.size())) {
    std::perror("handing an input to the same-host peer");
    std::abort();
  }
  uint8_t done = 0;
  while (::recv(g_child, &done, 1, 0) < 0 && errno == EINTR) {}
  if (done != 1) {
    std::fprintf(stderr, "the same-host peer died\n");
    std::abort();
  }
}

// The real p1 is still served by p0, through calls and the RRef protocol.
void expect_served() {
  try {
    if (g_p1->rpc_sync<int64_t>(0, "add", int64_t{2}, int64_t{3}) != 5) std::abort();
    rpc::RRef<Counter> c = g_p1->remote<Counter>(0, "Counter", int64_t{10});
    if (c.rpc_sync<int64_t>("add", int64_t{1}) != 11) std::abort();
    if (c.to_here().value != 11) std::abort();
    if (g_p1->rpc_sync<int64_t>(0, "peek", c) != 0) std::abort();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "p0 no longer serves p1: %s\n", e.what());
    std::abort();
  }
}

// --- The seed corpus ---------------------------------------------------------------------

using tdist::fuzz::rpc_call_header;
using tdist::fuzz::rpc_frame;
using tdist::fuzz::rpc_payload;

void write_seeds(const std::string& dir) {
  using Frames = std::vector<tdist::Bytes>;
  auto seed = [&](const std::string& name, const Frames& frames, uint8_t sender = 0) {
    tdist::Bytes all;
    for (const auto& f : frames) all.insert(all.end(), f.begin(), f.end());
    tdist::fuzz::write_seed(dir + "/" + name, sender, all);
  };
  std::vector<at::Tensor> ts;
  auto frame = [&](MessageType type, uint64_t id, const tdist::Bytes& body,
                   bool addresses = false) {
    tdist::Bytes f = rpc_frame(type, 0, id, body, ts, addresses);
    ts.clear();
    return f;
  };
  const auto counter = tdist::fuzz::rpc_method_header<Counter>;
  // p1's ids: RRef (1, n) created by p1, its forks (1, m).
  const rpc::RRefId rref{1, 1000};
  const rpc::ForkId fork{1, 1001};
  const at::Tensor a = at::arange(6, at::kFloat).reshape({2, 3});
  seed("call_add",
       {frame(MessageType::kCall, 1,
              rpc_payload(tdist::encode(rpc_call_header("add")), ts, int64_t{1}, int64_t{2}))});
  seed("call_sum", {frame(MessageType::kCall, 2,
                          rpc_payload(tdist::encode(rpc_call_header("sum")), ts, a,
                                      std::vector<at::Tensor>{a, a}))});
  // Tensors by address in the child's buffer (rpc_frame places them at kChildBuffer + 4 KiB
  // steps), large enough that the receiver reads them rather than asking for bytes.
  const at::Tensor big = at::arange(2048, at::kFloat);
  seed("call_sum_addresses",
       {frame(MessageType::kCall, 11,
              rpc_payload(tdist::encode(rpc_call_header("sum")), ts, big,
                          std::vector<at::Tensor>{big}),
              true)},
       1);
  const tdist::Bytes create =
      frame(MessageType::kRemoteCall, 3,
            rpc_payload(tdist::encode(rpc_call_header("Counter"), rref, fork), ts, int64_t{5}));
  const tdist::Bytes fetch = frame(
      MessageType::kRRefFetch, 4,
      rpc_payload(tdist::encode(rref, detail::type_info_of<Counter>().hash, std::string("Counter")),
                  ts));
  const tdist::Bytes method =
      frame(MessageType::kRRefMethodCall, 5,
            rpc_payload(tdist::encode(counter("add"), rref, rpc::ForkId{}), ts, int64_t{3}));
  const tdist::Bytes method_remote =
      frame(MessageType::kRRefMethodRemote, 6,
            rpc_payload(tdist::encode(counter("scaled"), rref, rpc::ForkId{}, rpc::RRefId{1, 1002},
                                      rpc::ForkId{1, 1003}),
                        ts, a));
  const tdist::Bytes fork_request =
      frame(MessageType::kRRefForkRequest, 7, tdist::encode(rref, rpc::ForkId{1, 1004}));
  const tdist::Bytes child_accept =
      frame(MessageType::kRRefChildAccept, 8, tdist::encode(rpc::ForkId{1, 1004}));
  const tdist::Bytes user_delete =
      frame(MessageType::kRRefUserDelete, 9, tdist::encode(rref, fork));
  const tdist::Bytes peek =
      frame(MessageType::kCall, 10,
            rpc_payload(tdist::encode(rpc_call_header("peek")), ts,
                        detail::ForkData{0, rref, rpc::ForkId{1, 1005}, 1,
                                         detail::type_info_of<Counter>().hash, "Counter"}));
  seed("rref_life",
       {create, fetch, method, method_remote, fork_request, child_accept, user_delete});
  seed("rref_delete_first", {create, user_delete, fetch, method});
  seed("rref_twice", {create, create, user_delete, user_delete});
  seed("rref_fork_only", {fork_request, child_accept, fork_request});
  seed("rref_as_argument", {create, peek, user_delete});
  seed("stray_response",
       {frame(MessageType::kResponse, 77, rpc_payload({}, ts, int64_t{3})),
        frame(MessageType::kError, 78, tdist::encode(detail::ErrorBody{"boom", "p1"})),
        frame(MessageType::kTensorRelease, 0, {})});
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  register_functions();
  tdist::fuzz::write_seeds_if_asked(write_seeds);
  start_child();  // before any thread: a fork copies only the calling one
  ::unsetenv("TDIST_TOKEN");
  ::unsetenv("TDIST_TOKEN_FILE");
  tdist::set_log_level(tdist::LogLevel::kOff);
  g_server = new tdist::TCPStoreServer("127.0.0.1", 0);
  auto start = [](int rank) {
    rpc::RpcOptions o;
    o.store = std::make_shared<tdist::TCPStore>("127.0.0.1", g_server->port(), false,
                                                std::chrono::seconds(30));
    o.listen_host = "127.0.0.1";
    o.rpc_timeout = tdist::Millis(5000);
    o.num_worker_threads = 4;
    return rpc::RpcAgent::start("p" + std::to_string(rank), rank, 2, o);
  };
  std::thread t([&] { g_p1 = start(1); });
  g_p0 = start(0);
  t.join();
  const uint16_t port = g_p0->port();
  if (::send(g_child, &port, sizeof(port), MSG_NOSIGNAL) != sizeof(port)) std::abort();
  expect_served();
  // No shutdown at exit: the workers' threads end with the process.
  std::atexit([] { expect_served(); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static uint64_t runs = 0;
  if (size == 0) return 0;
  if (data[0] & 1) {
    send_from_child(data + 1, size - 1);
  } else {
    send_input(g_p0->port(), false, data + 1, size - 1);
  }
  if (++runs % 64 == 0) expect_served();
  return 0;
}
