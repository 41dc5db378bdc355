#include "tdist/core/tcp_store.h"

#include <algorithm>

#include "tdist/core/detail/store_util.h"
#include "tdist/core/detail/tcp_store_client.h"
#include "tdist/core/detail/tcp_store_protocol.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/token.h"
#include "tdist/core/wire.h"

// Note [TCPStore protocol]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Handshake. A new connection first runs the connection handshake (service "store", no fields:
// Note [Connection handshake] in core/net/handshake.h). The server sends the challenge at
// accept and reads nothing else until the client's hello verified; a wrong or missing token,
// another protocol's bytes or a handshake that is not over within TDIST_STORE_FRAME_TIMEOUT_MS
// close the connection (counted in num_failed_handshakes()). A client whose hello is refused
// gets a ProtocolError at once (another token: retrying cannot help).
//
// Frames. Every request and every reply is
//     u32 magic 'TDST' | u16 version (1) | u16 command (request) or status (reply) | u64 body length
// followed by the body, all little-endian; bodies use core/wire.h (strings and blobs are u64
// length + bytes). Commands and their bodies are listed in detail/tcp_store_protocol.h.
//
// Validation. The server checks magic, version, command and body length (<= kMaxFrameBytes)
// from the 16 header bytes alone, before it reads or allocates any of the body; the body buffer
// then grows in 64 KiB steps as bytes arrive, so announcing a large body costs the server
// nothing until the bytes are really sent. Every length inside the body is checked against the
// bytes left (wire::Reader). Any violation (or a connection that ends inside a frame) is logged
// at error level and closes that one connection; the server and every other connection go on.
// A well-formed request that cannot be done (add() on a value that is not an integer) is not a
// protocol violation: it gets a kInvalid reply and the connection stays usable.
//
// Limits, so that no peer can make the server grow without bound or hold it:
//  - connections: TDIST_STORE_MAX_CONNECTIONS (3/4 of the descriptor limit by default). Each
//    holds at most one parked get/wait (one request at a time, below), with at most 65536 keys,
//    so waiters are bounded by connections.
//  - handshakes: one must be over within TDIST_STORE_HANDSHAKE_TIMEOUT_MS (10 s); one peer
//    address has at most TDIST_STORE_MAX_HANDSHAKES_PER_ADDRESS (16) connections in their
//    handshake. A new connection from an address at that budget displaces the address's oldest
//    handshake; one that finds the server at its connection limit displaces the oldest handshake
//    of all, and is closed at accept only when every connection is authenticated. So a stranger
//    that opens every slot and says nothing costs a rank a retry (the client retries a
//    connection closed in its handshake), never its place.
//  - request bodies: a body reserves its announced length against TDIST_STORE_MAX_INFLIGHT_BYTES
//    (1 GiB, over all connections) before a byte of it is read; one that does not fit waits,
//    unread, until earlier ones are dispatched or dropped (first come, first served; its frame
//    deadline starts when it is admitted). A set or compare_set whose length alone shows that it
//    could not be stored (more than the room left plus the largest entry it could replace), or a
//    body larger than the whole budget, is refused from its header with kInvalid naming the
//    limit; its body is then read into a scratch buffer and dropped, and the connection stays.
//  - data held: TDIST_STORE_MAX_KEYS keys (2^20) and TDIST_STORE_MAX_BYTES bytes of keys and
//    values together (4 GiB); a write past either gets kInvalid naming the limit, and nothing
//    already stored changes.
//  - a started frame: once its first byte arrived, the whole frame must arrive within
//    TDIST_STORE_FRAME_TIMEOUT_MS (60 s); a peer that stalls or trickles inside a frame loses
//    its connection. A connection idle between frames is not timed out: store clients
//    legitimately sit idle for the length of a job (torch's TCPStore clients too), and the
//    connection limit bounds them.
//
// One request at a time per connection. A client sends a request and waits for its reply before
// it sends the next on that socket. The server keeps reading while a get/wait is parked, only to
// notice a disconnect at once (the parked waiter is then dropped); a frame that arrives before
// the parked request was answered breaks this rule and closes the connection. Concurrency comes
// from more connections: a TCPStore keeps a pool, and each request takes an idle socket or opens
// one, so a thread parked in get() never delays another thread's set().
//
// Blocking requests. get and wait carry their timeout; the server parks them (per key, in one
// io thread: no locks) and answers as soon as a set/add/compare_set makes every key exist, or
// answers kTimeout with the keys still missing when the timer fires. A timed-out wait is thus an
// ordinary reply and leaves the connection usable. The client also bounds every exchange with
// its own deadline: the request's timeout (the store's timeout for non-blocking requests) plus a
// grace (that timeout, clamped to 1..5 s). When it passes, or the connection breaks, the socket
// is dropped (its state is unknown) and the caller gets TimeoutError / NetworkError naming
// host:port and the request.
// Nothing is retried after a request was sent: add() is not idempotent.
//
// Joining (TCPStoreOptions::num_workers). Each store adds 1 to kJoinedKey; the store that makes
// it reach num_workers sets kAllJoinedKey; every store waits for kAllJoinedKey with its timeout,
// and on timeout reports how many of num_workers had joined. These keys live under
// tcp_store::kInternalKeyPrefix, which num_keys() does not count.
//
// Shutdown. Destroying the server posts a shutdown to its io thread, which closes the acceptor
// and every connection (parked clients see EOF and throw NetworkError) and stops the loop. No
// handler blocks, so the join is prompt.

namespace tdist {
namespace {

using detail::tcp_store::Command;
using detail::tcp_store::Status;

// How long past a request's own timeout the client waits for the reply: room for the server's
// scheduling and the network, between 1 and 5 s.
Millis reply_grace(Millis timeout) { return std::clamp(timeout, Millis(1000), Millis(5000)); }
const std::string kJoinedKey = std::string(detail::tcp_store::kInternalKeyPrefix) + "joined";
const std::string kAllJoinedKey = std::string(detail::tcp_store::kInternalKeyPrefix) + "all_joined";

std::string quoted(const std::string& key) { return "'" + key + "'"; }

Millis limit_for(Millis timeout) {
  timeout = detail::effective_timeout(timeout);
  return timeout == Store::kNoTimeout ? Store::kNoTimeout : timeout + reply_grace(timeout);
}

// One exchange; a kInvalid reply becomes InvalidArgument with the server's message.
detail::TCPStoreClient::Reply call(detail::TCPStoreClient& client, Command cmd, const Bytes& body,
                                   Millis limit, const std::string& what) {
  auto reply = client.request(cmd, body, limit, what);
  if (reply.status == Status::kInvalid) {
    wire::Reader r(reply.body);
    throw InvalidArgument(r.string("message"));
  }
  return reply;
}

// Throws the store's TimeoutError when the server answered kTimeout (naming the missing keys).
void throw_if_timed_out(const detail::TCPStoreClient::Reply& reply, const std::string& address,
                        const std::vector<std::string>& keys, Millis timeout) {
  if (reply.status != Status::kTimeout) return;
  wire::Reader r(reply.body);
  std::vector<std::string> missing = detail::tcp_store::read_keys(r);
  detail::throw_wait_timeout("TCPStore at " + address, missing.empty() ? keys : missing, timeout);
}

Bytes read_value(const detail::TCPStoreClient::Reply& reply) {
  wire::Reader r(reply.body);
  Bytes value = r.blob("value");
  r.expect_end("reply");
  return value;
}

}  // namespace

TCPStore::TCPStore(const std::string& host, uint16_t port, bool is_server, Millis timeout)
    : TCPStore(TCPStoreOptions{host, port, is_server, -1, timeout, std::nullopt, {}}) {}

TCPStore::TCPStore(TCPStoreOptions options) : Store(options.timeout), options_(std::move(options)) {
  TDIST_CHECK_ARG(!options_.host.empty(), "TCPStore needs a host");
  TDIST_CHECK_ARG(options_.is_server || options_.port != 0,
                  "TCPStore client needs a port (only a server may use port 0)");
  if (options_.is_server) {
    TCPStoreServerOptions server = options_.server;
    if (!server.token) server.token = options_.token;
    server_ = std::make_unique<TCPStoreServer>(options_.host, options_.port, server);
    options_.port = server_->port();
  }
  client_ = std::make_unique<detail::TCPStoreClient>(
      options_.host, options_.port, options_.timeout,
      resolve_token(options_.token, "TCPStoreOptions::token").value);
  if (options_.num_workers > 0) join();
}

TCPStore::~TCPStore() = default;

void TCPStore::join() {
  const int64_t joined = add(kJoinedKey, 1);
  if (joined == options_.num_workers) set(kAllJoinedKey, "1");
  if (joined > options_.num_workers) {
    TDIST_LOG_WARN("TCPStore at ", client_->address(), ": ", joined,
                   " stores joined but num_workers is ", options_.num_workers);
  }
  try {
    wait({kAllJoinedKey}, options_.timeout);
  } catch (const TimeoutError&) {
    int64_t now_joined = detail::parse_counter(kJoinedKey, get(kJoinedKey));
    TDIST_THROW(TimeoutError, "TCPStore at ", client_->address(), ": timed out after ",
                detail::seconds_text(options_.timeout), " s waiting for ", options_.num_workers,
                " workers to join; ", now_joined, " of ", options_.num_workers, " joined");
  }
}

void TCPStore::set(const std::string& key, const Bytes& value) {
  Bytes body;
  wire::Writer w(body);
  w.string(key);
  w.blob(value);
  auto reply =
      call(*client_, Command::kSet, body, limit_for(timeout()), "set(" + quoted(key) + ")");
  wire::Reader(reply.body).expect_end("set reply");
}

Bytes TCPStore::get(const std::string& key) {
  const Millis t = timeout();
  Bytes body;
  wire::Writer w(body);
  w.string(key);
  w.i64(t.count());
  auto reply = call(*client_, Command::kGet, body, limit_for(t), "get(" + quoted(key) + ")");
  throw_if_timed_out(reply, client_->address(), {key}, t);
  return read_value(reply);
}

int64_t TCPStore::add(const std::string& key, int64_t delta) {
  Bytes body;
  wire::Writer w(body);
  w.string(key);
  w.i64(delta);
  auto reply =
      call(*client_, Command::kAdd, body, limit_for(timeout()), "add(" + quoted(key) + ")");
  wire::Reader r(reply.body);
  int64_t value = r.i64("value");
  r.expect_end("add reply");
  return value;
}

Bytes TCPStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  Bytes body;
  wire::Writer w(body);
  w.string(key);
  w.blob(expected);
  w.blob(desired);
  return read_value(call(*client_, Command::kCompareSet, body, limit_for(timeout()),
                         "compare_set(" + quoted(key) + ")"));
}

void TCPStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  Bytes body;
  wire::Writer w(body);
  detail::tcp_store::write_keys(w, keys);
  w.i64(timeout.count());
  auto reply = call(*client_, Command::kWait, body, limit_for(timeout),
                    "wait(" + detail::join_keys(keys) + ")");
  throw_if_timed_out(reply, client_->address(), keys, timeout);
  wire::Reader(reply.body).expect_end("wait reply");
}

bool TCPStore::check(const std::vector<std::string>& keys) {
  Bytes body;
  wire::Writer w(body);
  detail::tcp_store::write_keys(w, keys);
  auto reply = call(*client_, Command::kCheck, body, limit_for(timeout()),
                    "check(" + detail::join_keys(keys) + ")");
  wire::Reader r(reply.body);
  bool present = r.u8("present") != 0;
  r.expect_end("check reply");
  return present;
}

bool TCPStore::delete_key(const std::string& key) {
  Bytes body;
  wire::Writer(body).string(key);
  auto reply = call(*client_, Command::kDelete, body, limit_for(timeout()),
                    "delete_key(" + quoted(key) + ")");
  wire::Reader r(reply.body);
  bool existed = r.u8("existed") != 0;
  r.expect_end("delete_key reply");
  return existed;
}

int64_t TCPStore::num_keys() {
  auto reply = call(*client_, Command::kNumKeys, {}, limit_for(timeout()), "num_keys()");
  wire::Reader r(reply.body);
  int64_t n = r.i64("count");
  r.expect_end("num_keys reply");
  return n;
}

}  // namespace tdist
