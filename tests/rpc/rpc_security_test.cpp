// What a peer that passed (or is still in) the handshake cannot do (issue 15, RPC items 1-4):
// make a worker read its own memory through the same-host fast path, get in without the job's
// token, answer another worker's call, delete a fork it does not hold, grow the owner's tables
// with bogus RRef ids, or hold threads with slow or idle connections. Hostile peers are raw
// sockets (tests/rpc/raw_peer.h) or real agents sending messages they should not.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <future>

#include "tdist/core/env.h"
#include "tdist/rpc/detail/same_host.h"
#include "tests/harness/env_guard.h"
#include "tests/harness/process.h"
#include "tests/harness/handshake_attacks.h"
#include "tests/rpc/raw_peer.h"
#include "tests/rpc/rpc_test_util.h"

namespace tdist::rpc::test {
namespace {

using detail::FrameHeader;
using detail::MessageType;
using tdist::test::EnvGuard;

const std::string kToken = "s3cret";

RpcOptions with_token() {
  RpcOptions o;
  o.token = kToken;
  return o;
}

// ---- 1. the same-host fast path -------------------------------------------------------------

constexpr size_t kSecretBytes = 1 << 20;  // above the fast path's threshold
constexpr uint8_t kSecretByte = 0x5a;

uint8_t* secret() {
  static uint8_t* s = [] {
    auto* p = new uint8_t[kSecretBytes];
    std::memset(p, kSecretByte, kSecretBytes);
    return p;
  }();
  return s;
}

std::atomic<int> probes_with_secret{0};

void register_probe() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_test_functions();
    register_function("security_probe", [](at::Tensor t) -> int64_t {
      const auto* p = static_cast<const uint8_t*>(t.data_ptr());
      const bool leaked = t.nbytes() > 0 && std::all_of(p, p + t.nbytes(),
                                                        [](uint8_t b) { return b == kSecretByte; });
      if (leaked) ++probes_with_secret;
      return leaked ? 1 : 0;
    });
  });
}

// A peer in another process that authenticates (it has the token), claims to be the worker's
// own process and sends a call whose tensor "lives" at the worker's secret. Exit 0: the worker
// closed the connection without answering; 1: it answered; 2: it believed the pid (and closed).
TDIST_TEST_CHILD(rpc_forged_pid) {
  const auto port = static_cast<uint16_t>(env::require_int("AGENT_PORT", 1, 65535));
  const auto victim = static_cast<pid_t>(env::require_int("VICTIM_PID", 1, INT32_MAX));
  const uint64_t address = std::stoull(env::require("SECRET_ADDRESS"));
  int fd = connect_raw(port);
  const bool believed = forged_handshake(fd, kToken, 0, victim);
  at::Tensor t = torch::empty({static_cast<int64_t>(kSecretBytes)}, torch::kUInt8);
  detail::OutMessage m =
      detail::encode_message(MessageType::kCall, nullptr, 1,
                             std::make_tuple(detail::CallHeader{
                                 "security_probe", signature_of<int64_t, at::Tensor>().hash}),
                             t);
  detail::TensorSection section;
  section.metas.push_back(describe_tensor(t));
  section.addresses.push_back(address);
  FrameHeader h;
  h.type = MessageType::kCall;
  h.id = 1;
  add_tensor_section(h, m.body, section);
  send_frame(fd, h, m.body);
  if (!closed_by_peer(fd)) return 1;
  return believed ? 2 : 0;
}

TEST(RpcFastPath, AForgedPidCannotMakeAWorkerReadItsOwnMemory) {
  register_probe();
  auto a = start_agents(2, with_token());
  tdist::test::Processes child(
      "rpc_forged_pid", 1,
      {{"AGENT_PORT", std::to_string(a[1]->port())},
       {"VICTIM_PID", std::to_string(::getpid())},
       {"SECRET_ADDRESS", std::to_string(reinterpret_cast<uintptr_t>(secret()))}});
  auto r = child.wait_all(60s);
  EXPECT_TRUE(r[0].ok()) << r[0].describe() << "\n" << r[0].output;
  EXPECT_EQ(probes_with_secret.load(), 0);
  EXPECT_EQ(a[0]->rpc_sync<int64_t>("w1", "add", int64_t{2}, int64_t{3}), 5);
  shutdown_all(a);
}

// An honest peer in another process: the worker (its parent here) confirms its pid and reads
// its memory. Exit 0: the server will read our tensors; 3: it will not.
TDIST_TEST_CHILD(rpc_honest_fast_path) {
  const auto port = static_cast<uint16_t>(env::require_int("AGENT_PORT", 1, 65535));
  int fd = connect_raw(port);
  auto o = raw_options(kToken);
  o.fast_path = true;
  auto hs = detail::client_handshake(fd, o, 1);
  std::printf("server reads us: %d, we read the server: %d\n", hs.send_remote_tensors,
              hs.read_remote_tensors);
  ::close(fd);
  return hs.send_remote_tensors ? 0 : 3;
}

TEST(RpcFastPath, ARealLocalPeerGetsIt) {
  register_probe();
  auto a = start_agents(2, with_token());
  expect_raw_peer_passes("rpc_honest_fast_path", a[1]->port());
  shutdown_all(a);
}

TEST(RpcFastPath, TheCheckNamesOnlyTheProcessThatHoldsThePeerSocket) {
  auto a = start_agents(1, with_token());
  int fd = connect_raw(a[0]->port());
  uint8_t challenge[40];  // sent once the agent accepted: its end has a descriptor now
  net::read_exact(fd, challenge, sizeof(challenge), soon(), "challenge");
  std::string why;
  // Seen from the client socket, the peer's end is the agent's: held by this process.
  EXPECT_TRUE(detail::peer_is_local_process(fd, ::getpid(), &why)) << why;
  EXPECT_FALSE(detail::peer_is_local_process(fd, ::getppid(), &why));
  EXPECT_NE(why.find("does not hold"), std::string::npos) << why;
  EXPECT_FALSE(detail::peer_is_local_process(fd, 0, &why));
  ::close(fd);
  shutdown_all(a);
}

// ---- 2. where the token comes from ----------------------------------------------------------

// Agents started with RpcOptions::token unset take the environment's token: a raw peer with
// it gets through, with another one or none it is refused.
void expect_token_in_force(const std::string& token) {
  auto a = start_agents(2);
  EXPECT_EQ(a[0]->rpc_sync<int64_t>("w1", "add", int64_t{1}, int64_t{2}), 3);
  int fd = connect_raw(a[1]->port());
  EXPECT_NO_THROW(detail::client_handshake(fd, raw_options(token), 1));
  ::close(fd);
  for (std::string wrong : {token + "x", std::string()}) {
    fd = connect_raw(a[1]->port());
    EXPECT_THROW(detail::client_handshake(fd, raw_options(wrong), 1), ProtocolError) << wrong;
    EXPECT_TRUE(closed_by_peer(fd));
    ::close(fd);
  }
  shutdown_all(a);
}

TEST(RpcTokenSource, TdistTokenIsUsed) {
  EnvGuard env({{"TDIST_TOKEN", "from-env"}, {"TDIST_TOKEN_FILE", std::nullopt}});
  expect_token_in_force("from-env");
}

TEST(RpcTokenSource, TdistTokenFileIsUsedAndAnOpenFileRefused) {
  const std::string path = tdist::test::temp_dir("rpc-token") + "/token";
  std::ofstream(path) << "from-file\n";
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  EnvGuard env({{"TDIST_TOKEN", std::nullopt}, {"TDIST_TOKEN_FILE", path}});
  expect_token_in_force("from-file");
  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
  RpcOptions o;
  o.store = std::make_shared<HashStore>(10000ms);
  try {
    RpcAgent::start("w0", 0, 1, o);
    FAIL() << "a token file others can read was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("0644"), std::string::npos) << e.what();
  }
}

TEST(RpcTokenSource, NoTokenLogsOneWarningNamingThePort) {
  EnvGuard env({{"TDIST_TOKEN", std::nullopt}, {"TDIST_TOKEN_FILE", std::nullopt}});
  register_test_functions();
  ::testing::internal::CaptureStderr();
  auto a = start_agents(1);
  EXPECT_EQ(a[0]->rpc_sync<int64_t>("w0", "add", int64_t{1}, int64_t{2}), 3);
  const std::string err = ::testing::internal::GetCapturedStderr();
  size_t count = 0;
  for (size_t at = err.find("unauthenticated"); at != std::string::npos;
       at = err.find("unauthenticated", at + 1)) {
    ++count;
  }
  EXPECT_EQ(count, 1u) << err;
  EXPECT_NE(err.find(":" + std::to_string(a[0]->port()) + " is unauthenticated"), std::string::npos)
      << err;
  shutdown_all(a);
}

// ---- 3. responses and RRef messages from the wrong peer -------------------------------------

TEST(RpcResponses, APeerCannotAnswerAnotherWorkersCall) {
  auto a = start_agents(2, with_token());
  auto f = a[0]->rpc_async<int64_t>("w1", "sleep_ms", int64_t{500});
  // An authenticated stranger (claiming to be w1) answers every id w0 may have used.
  int fd = connect_raw(a[0]->port());
  detail::client_handshake(fd, raw_options(kToken, 1), 0);
  Bytes forged = encode(int64_t{666});
  for (uint64_t id = 1; id <= 64; ++id) {
    FrameHeader h;
    h.type = MessageType::kResponse;
    h.id = id;
    h.body_len = static_cast<uint32_t>(forged.size());
    h.length = forged.size();
    send_frame(fd, h, forged);
  }
  EXPECT_EQ(f.value(), 500);  // the real answer, from w1's own connection
  ::close(fd);
  shutdown_all(a);
}

// Sends `m` from `from` to rank `to` and returns the error it got ("" when answered).
std::string request(RpcAgent& from, int to, detail::OutMessage m) {
  auto answered = std::make_shared<std::promise<std::string>>();
  from.send_request(
      to, std::move(m), 10s,
      [answered](detail::Message*, std::exception_ptr e) {
        std::string what;
        if (e) {
          try {
            std::rethrow_exception(e);
          } catch (const std::exception& x) {
            what = x.what();
          }
        }
        answered->set_value(what);
      },
      "test request");
  return answered->get_future().get();
}

TEST(RpcRRefSecurity, AWorkerCannotDeleteAForkItDoesNotHold) {
  register_test_functions();
  auto a = start_agents(3);
  const int64_t live = Tracked::live.load();
  {
    auto rref = a[0]->remote<Tracked>("w1", "Tracked", int64_t{7});
    ASSERT_EQ(rref.to_here().id(), 7);
    const auto fork = std::static_pointer_cast<detail::UserRRef>(rref.impl())->fork_id();
    ASSERT_EQ(a[1]->rref_context().num_forks(rref.id()), 1u);
    // w2 says the fork that w0 holds is gone.
    auto del = detail::encode_message(MessageType::kRRefUserDelete, &a[2]->rref_context(), 1,
                                      std::make_tuple(rref.id(), fork));
    const std::string error = request(*a[2], 1, std::move(del));
    EXPECT_NE(error.find("not held by worker rank 2"), std::string::npos) << error;
    EXPECT_EQ(a[1]->rref_context().num_forks(rref.id()), 1u);
    EXPECT_EQ(rref.to_here().id(), 7);
    // Nor can w2 claim that fork as its own, even with the RRef's secret.
    const auto secret = std::static_pointer_cast<detail::UserRRef>(rref.impl())->secret();
    auto claim = detail::encode_message(MessageType::kRRefForkRequest, &a[2]->rref_context(), 1,
                                        std::make_tuple(rref.id(), fork, secret));
    EXPECT_NE(request(*a[2], 1, std::move(claim)).find("held by another worker"),
              std::string::npos);
  }
  // w0's own deletion still works: the value goes.
  EXPECT_TRUE(eventually([&] { return Tracked::live.load() == live; }));
  shutdown_all(a);
  for (auto& agent : a.agents) EXPECT_TRUE(agent->leaked_rrefs().empty());
}

TEST(RpcRRefSecurity, BogusFetchesAreBoundedAndCreateNoOwners) {
  RpcOptions o;
  o.rpc_timeout = 30s;  // placeholders would wait this long for their creating call
  auto a = start_agents(3, o);
  auto& owner = a[1]->rref_context();
  const size_t owned = owner.num_owned();
  const size_t limit = detail::RRefContext::kMaxParkedPerPeer;
  std::atomic<size_t> refused{0};
  auto bogus_fetches = [&](int64_t first, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      // Ids "made by w2" that w2 never made: the owner cannot tell them from a creating call
      // still on its way, so it parks them, up to the limit.
      auto m = detail::encode_message(MessageType::kRRefFetch, &a[2]->rref_context(), 1,
                                      std::make_tuple(RRefId{2, first + static_cast<int64_t>(i)},
                                                      uint64_t{0}, std::string("bogus")));
      a[2]->send_request(
          1, std::move(m), 2s,
          [&refused](detail::Message*, std::exception_ptr e) {
            try {
              if (e) std::rethrow_exception(e);
            } catch (const RemoteError&) {
              ++refused;  // answered by the owner (not our own timeout)
            } catch (...) {}
          },
          "bogus fetch");
    }
  };
  bogus_fetches(1'000'000, limit + 50);
  EXPECT_TRUE(eventually([&] { return refused.load() >= 50; }, 10s)) << refused.load();
  EXPECT_EQ(owner.num_parked(), limit);
  const size_t unborn = owner.num_unborn();
  EXPECT_LE(unborn, limit);
  // More of them cost nothing more: each is refused at once.
  bogus_fetches(2'000'000, 100);
  EXPECT_TRUE(eventually([&] { return refused.load() >= 150; }, 10s)) << refused.load();
  EXPECT_EQ(owner.num_unborn(), unborn);
  EXPECT_EQ(owner.num_owned(), owned);
  // Another worker is not held up by w2's quota.
  auto r = a[0]->remote<int64_t>("w1", "add", int64_t{1}, int64_t{2});
  EXPECT_EQ(r.to_here(), 3);
  shutdown_all(a, false);
}

// ---- 4. connection limits -------------------------------------------------------------------

// A method call waiting for an RRef whose creating call has not come holds its target and the
// connection it will answer on. When the agent goes first, the wait goes with it: before, the
// waiter held the target that held the waiter, so both (and the connection's buffer) were kept
// for ever (found by fuzz_rpc_agent's leak check).
TEST(RpcRRefSecurity, AMethodCallWaitingForAnUnbornRRefIsFreedWithTheAgent) {
  RpcOptions o;
  o.rpc_timeout = 30s;  // the placeholder does not expire during the test
  auto a = start_agents(2, o);
  const RRefId never{0, 123456789};  // "made by w0", which never creates it
  auto m = detail::encode_message(MessageType::kRRefMethodCall, &a[0]->rref_context(), 1,
                                  std::make_tuple(detail::CallHeader{"add", 0}, never, ForkId{}));
  a[0]->send_request(
      1, std::move(m), 2s, [](detail::Message*, std::exception_ptr) {},
      "method call on an unborn RRef");
  ASSERT_TRUE(eventually([&] { return a[1]->rref_context().num_unborn() == 1; }));
  std::weak_ptr<detail::OwnerRRef> placeholder = a[1]->rref_context().find_owner(never, nullptr, 0);
  ASSERT_FALSE(placeholder.expired());
  shutdown_all(a, false);
  a.agents.clear();
  EXPECT_TRUE(eventually([&] { return placeholder.expired(); }, 5s));
}

TEST(RpcConnectionLimits, ATricklingClientIsDroppedAtTheHandshakeDeadline) {
  RpcOptions o = with_token();
  o.handshake_timeout = 500ms;
  auto a = start_agents(2, o);
  int fd = connect_raw(a[1]->port());
  uint8_t challenge[40];
  net::read_exact(fd, challenge, sizeof(challenge), soon(), "challenge");
  bool dropped = false;
  // One byte every 100 ms: each byte comes well within the deadline, the whole never does.
  for (int i = 0; i < 40 && !dropped; ++i) {
    send_bytes(fd, "x", 1);
    if (i == 2) {
      EXPECT_EQ(a[0]->rpc_sync<int64_t>("w1", "add", int64_t{2}, int64_t{3}), 5);
    }
    std::this_thread::sleep_for(100ms);
    dropped = closed_now(fd);
  }
  EXPECT_TRUE(dropped) << "still connected after trickling for 4 s";
  ::close(fd);
  shutdown_all(a);
}

// RPC's port under the hostile clients every port is tested with (the store's and the mesh's
// too: tests/harness/handshake_attacks.h); the workers go on serving each other.
TEST(RpcConnectionLimits, StrangersReplaysAndStallsAreRefusedAndTheJobGoesOn) {
  RpcOptions o = with_token();
  o.handshake_timeout = 500ms;
  auto a = start_agents(2, o);
  tdist::test::HandshakePort port{"127.0.0.1", a[1]->port(), net::Service::kRpc, 12};
  EXPECT_TRUE(tdist::test::refuses_token(port, ""));
  EXPECT_TRUE(tdist::test::refuses_token(port, "wrong"));
  EXPECT_TRUE(tdist::test::refuses_replayed_hello(port, kToken));
  const int stalled = tdist::test::stalled_handshake(port, kToken);
  EXPECT_EQ(a[0]->rpc_sync<int64_t>("w1", "add", int64_t{2}, int64_t{3}), 5);
  EXPECT_TRUE(tdist::test::closed_within(stalled, 5s));
  ::close(stalled);
  EXPECT_EQ(a[1]->rpc_sync<int64_t>("w0", "add", int64_t{4}, int64_t{5}), 9);
  shutdown_all(a);
}

TEST(RpcConnectionLimits, IdleStrangersDoNotLockOutARealPeer) {
  EnvGuard env({{"TDIST_RPC_MAX_PENDING_HANDSHAKES", std::string("4")}});
  RpcOptions o = with_token();
  o.handshake_timeout = 60s;  // the limit, not the deadline, has to deal with them
  auto a = start_agents(2, o);
  std::vector<int> idle;
  for (int i = 0; i < 16; ++i) idle.push_back(connect_raw(a[1]->port()));
  EXPECT_EQ(a[0]->rpc_sync<int64_t>("w1", "add", int64_t{2}, int64_t{3}), 5);
  auto closed = [&] {
    return std::count_if(idle.begin(), idle.end(), [](int fd) { return closed_now(fd); });
  };
  // At most 4 handshakes pending once w0's has come in: the 13 oldest strangers are gone.
  EXPECT_TRUE(eventually([&] { return closed() >= 13; }, 10s)) << closed();
  for (int fd : idle) ::close(fd);
  shutdown_all(a);
}

TEST(RpcConnectionLimits, APeerStalledMidFrameIsDisconnectedAnIdleOneIsNot) {
  RpcOptions o = with_token();
  o.rpc_timeout = 1s;
  auto a = start_agents(2, o);
  auto authenticated = [&] {
    int fd = connect_raw(a[1]->port());
    detail::client_handshake(fd, raw_options(kToken), 1);
    return fd;
  };
  int idle = authenticated();
  int stalled = authenticated();
  FrameHeader h;
  h.type = MessageType::kCall;
  h.body_len = 100;
  h.length = 100;
  auto b = header_bytes(h);
  send_bytes(stalled, b.data(), 10);  // a quarter of a header, then nothing
  EXPECT_TRUE(closed_by_peer(stalled));
  ::close(stalled);
  // Waiting between frames is no stall: the idle connection still works.
  std::this_thread::sleep_for(1500ms);
  EXPECT_FALSE(closed_now(idle));
  Bytes body;
  FrameHeader call = add_call(9, &body);
  send_frame(idle, call, body);
  std::vector<uint8_t> reply;
  EXPECT_EQ(read_frame(idle, &reply).type, MessageType::kResponse);
  EXPECT_EQ(decode<int64_t>(reply), 42);
  ::close(idle);
  shutdown_all(a);
}

// ---- 5. RRef authorization (issue 41 item 7) ------------------------------------------------

// A REMOTE_CALL from `from` to rank `to` creating `id` with fork `fork`, running "add"(a, b).
detail::OutMessage remote_add(RpcAgent& from, int to, RRefId id, ForkId fork, int64_t a,
                              int64_t b) {
  return detail::encode_message(
      MessageType::kRemoteCall, &from.rref_context(), to,
      std::make_tuple(detail::CallHeader{"add", signature_of<int64_t, int64_t, int64_t>().hash}, id,
                      fork, detail::RRefSecret::random()),
      a, b);
}

// RRef ids are {creator, counter}: w2 can tell w0's next one. Before, w2's REMOTE_CALL under
// that id made the owner, and w0's own remote() then found it: w0 read w2's value.
TEST(RpcRRefSecurity, ARemoteCallCannotSquatOrReuseAnRRefId) {
  register_test_functions();
  auto a = start_agents(3);
  const RRefId taken = a[0]->rref_context().new_id();
  // w0's next remote() takes the next two ids (its RRef's and its fork's, in either order).
  const RRefId next[2] = {{0, taken.local_id + 1}, {0, taken.local_id + 2}};
  for (const RRefId& id : next) {
    std::string error = request(*a[2], 1, remote_add(*a[2], 1, id, ForkId{2, 1'000'001}, 40, 2));
    EXPECT_NE(error.find("made by worker rank 0"), std::string::npos) << error;
  }
  auto r = a[0]->remote<int64_t>("w1", "add", int64_t{1}, int64_t{2});
  ASSERT_TRUE(r.id() == next[0] || r.id() == next[1]) << r.id().str();
  EXPECT_EQ(r.to_here(), 3);
  std::string error;
  // Its own ids, once: a second REMOTE_CALL under an id that exists is refused.
  const RRefId own = a[2]->rref_context().new_id();  // with a fork: it stays registered
  EXPECT_EQ(request(*a[2], 1, remote_add(*a[2], 1, own, a[2]->rref_context().new_id(), 1, 1)), "");
  error = request(*a[2], 1, remote_add(*a[2], 1, own, ForkId{}, 5, 5));
  EXPECT_NE(error.find("already exists"), std::string::npos) << error;
  // Nor may the new user fork be another worker's.
  error = request(*a[2], 1,
                  remote_add(*a[2], 1, a[2]->rref_context().new_id(), ForkId{0, 1'000'002}, 1, 1));
  EXPECT_NE(error.find("made by worker rank 0"), std::string::npos) << error;
  shutdown_all(a, false);
}

// Only a worker that holds a fork of an RRef reads it or calls its methods: before, any worker
// that named the id (a predictable {creator, counter}) got the value.
TEST(RpcRRefSecurity, FetchesAndMethodCallsNeedAFork) {
  register_test_functions();
  auto a = start_agents(3);
  auto rref = a[0]->remote<Tracked>("w1", "Tracked", int64_t{7});
  ASSERT_EQ(rref.to_here().id(), 7);
  const auto& ti = detail::type_info_of<Tracked>();
  auto fetch = detail::encode_message(MessageType::kRRefFetch, &a[2]->rref_context(), 1,
                                      std::make_tuple(rref.id(), ti.hash, ti.name));
  std::string error = request(*a[2], 1, std::move(fetch));
  EXPECT_NE(error.find("holds no fork"), std::string::npos) << error;
  auto method = detail::encode_message(
      MessageType::kRRefMethodCall, &a[2]->rref_context(), 1,
      std::make_tuple(detail::CallHeader{"add", signature_of<int64_t, int64_t>().hash}, rref.id(),
                      ForkId{}),
      int64_t{100});
  error = request(*a[2], 1, std::move(method));
  EXPECT_NE(error.find("holds no fork"), std::string::npos) << error;
  EXPECT_EQ(rref.to_here().id(), 7) << "a refused method call changed the value";
  // The holder, and a worker it shared the RRef with, still can.
  EXPECT_EQ(rref.rpc_sync<int64_t>("add", int64_t{1}), 8);
  EXPECT_EQ(a[0]->rpc_sync<int64_t>("w2", "rref_id_of", rref), 8);
  shutdown_all(a);
}

// Note [RRef protocol] invariant 8 (issue 41 item 7's gap): a worker that was never given an RRef
// cannot become its holder by a FORK_REQUEST with a fork id it made up (on main up to this
// change the owner registered any such fork: docs/rpc.md said "Not closed"), nor by sending the
// RRef back to its owner as an argument; the fork and the value stay the real holder's.
TEST(RpcRRefSecurity, AForgedForkRequestIsRefusedAndTheRRefIsNotHeld) {
  register_test_functions();
  auto a = start_agents(3);
  auto rref = a[0]->remote<Tracked>("w1", "Tracked", int64_t{7});
  ASSERT_EQ(rref.to_here().id(), 7);
  auto& owner = a[1]->rref_context();
  ASSERT_EQ(owner.num_forks(rref.id()), 1u);
  for (const detail::RRefSecret& guess : {detail::RRefSecret{}, detail::RRefSecret::random()}) {
    auto claim = detail::encode_message(MessageType::kRRefForkRequest, &a[2]->rref_context(), 1,
                                        std::make_tuple(rref.id(), ForkId{2, 1'000'003}, guess));
    const std::string error = request(*a[2], 1, std::move(claim));
    EXPECT_NE(error.find("does not carry the RRef's secret"), std::string::npos) << error;
  }
  EXPECT_EQ(owner.num_forks(rref.id()), 1u);
  EXPECT_FALSE(owner.holds_fork(rref.id(), 2)) << "the forged fork request made w2 a holder";
  const auto& ti = detail::type_info_of<Tracked>();
  auto fetch = detail::encode_message(MessageType::kRRefFetch, &a[2]->rref_context(), 1,
                                      std::make_tuple(rref.id(), ti.hash, ti.name));
  std::string error = request(*a[2], 1, std::move(fetch));
  EXPECT_NE(error.find("holds no fork"), std::string::npos) << error;
  // The RRef sent back to its owner in a call's arguments, with fork data w2 made up.
  detail::ForkData forged{1,       rref.id(), ForkId{2, 1'000'004},        2,
                          ti.hash, ti.name,   detail::RRefSecret::random()};
  auto call =
      detail::encode_message(MessageType::kCall, &a[2]->rref_context(), 1,
                             std::make_tuple(detail::CallHeader{
                                 "rref_fetch", signature_of<int64_t, RRef<Tracked>>().hash}),
                             forged);
  error = request(*a[2], 1, std::move(call));
  EXPECT_NE(error.find("does not carry the RRef's secret"), std::string::npos) << error;
  // A worker the holder gave it to still becomes a holder (its fork request carries the secret).
  EXPECT_EQ(a[0]->rpc_sync<int64_t>("w2", "rref_id_of", rref), 7);
  EXPECT_EQ(rref.to_here().id(), 7);
  shutdown_all(a);
  for (auto& agent : a.agents) EXPECT_TRUE(agent->leaked_rrefs().empty());
}

}  // namespace
}  // namespace tdist::rpc::test
