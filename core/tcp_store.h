#pragma once
// TCPStore: a Store served over TCP. One process runs the server (TCPStoreServer, a Boost.Asio
// event loop on its own thread); every process, the server's included, talks to it through a
// client connection.
//
// Every connection first passes the connection handshake (Note [Connection handshake] in
// core/net/handshake.h), which authenticates both ends with the job's token; the server reads
// no request from a peer that failed it. Then (Note [TCPStore protocol] in tcp_store.cpp) each
// request and reply is a frame
//   u32 magic 'TDST' | u16 version | u16 command-or-status | u64 body length | body
// The server checks magic, version and a maximum body length (kMaxFrameBytes) before reading
// or allocating the body; a bad frame closes that connection only (logged), the server keeps
// serving the others. The server reads a connection's next request only once the previous
// reply is written (a peer that pipelines requests without reading costs one reply), a key list
// holds at most 65536 keys, and connections beyond a limit are closed as they are accepted.
// Blocking get/wait are served by the server with the timeout the client
// sends, so a timed-out wait leaves the connection usable; the client also keeps its own
// deadline (timeout + grace) so that a dead server gives a NetworkError/TimeoutError, not a hang.
//
// Thread safety: a TCPStore may be used from many threads at once. Each request takes an idle
// connection of the store's small pool (or opens one), so a thread blocked in get/wait never
// holds up another thread's set. Blocking: get/wait block up to their timeout; every other call
// up to the store's timeout when the server does not answer.

#include <memory>
#include <optional>
#include <string>

#include "tdist/core/store.h"

namespace tdist {

namespace detail {
class TCPStoreServerImpl;
class TCPStoreClient;
}  // namespace detail

// A store server's settings. Each limit that is unset takes its TDIST_STORE_* variable, else
// the default (docs/configuration.md has the table); the environment is read once, when the
// server starts. A value out of range is an InvalidArgument naming the field or the variable.
struct TCPStoreServerOptions {
  // The connection handshake's token; unset: TDIST_TOKEN / TDIST_TOKEN_FILE (core/token.h);
  // empty: none (refused beyond loopback unless allow_no_token).
  std::optional<std::string> token;
  // Connections open at once (TDIST_STORE_MAX_CONNECTIONS; 3/4 of the descriptor limit, at
  // least 64); beyond it the oldest connection still in its handshake is displaced, else the
  // new one is closed.
  std::optional<int64_t> max_connections;
  std::optional<int64_t> max_keys;   // keys held (TDIST_STORE_MAX_KEYS; 2^20)
  std::optional<int64_t> max_bytes;  // bytes of keys and values held (TDIST_STORE_MAX_BYTES; 4 GiB)
  // A frame, once begun, must be whole within it (TDIST_STORE_FRAME_TIMEOUT_MS; 60 s).
  std::optional<Millis> frame_timeout;
  // The handshake must end within it (TDIST_STORE_HANDSHAKE_TIMEOUT_MS; 10 s).
  std::optional<Millis> handshake_timeout;
  // Connections of one address in their handshake at once
  // (TDIST_STORE_MAX_HANDSHAKES_PER_ADDRESS; 16).
  std::optional<int64_t> max_handshakes_per_address;
  // Bytes of request bodies taken in at once (TDIST_STORE_MAX_INFLIGHT_BYTES; kMaxFrameBytes).
  std::optional<int64_t> max_inflight_bytes;
  // Listen beyond loopback without a token (TDIST_ALLOW_NO_TOKEN; false).
  std::optional<bool> allow_no_token;
};

// A running store server. Stops (and closes every connection) when destroyed.
class TCPStoreServer {
 public:
  static constexpr uint64_t kMaxFrameBytes = uint64_t(1) << 30;  // 1 GiB

  // Binds host:port (port 0 picks a free one) and starts serving on a background thread.
  // `token` authenticates every client (unset: TDIST_TOKEN / TDIST_TOKEN_FILE, core/token.h;
  // empty: none). Throws NetworkError when the address cannot be bound.
  TCPStoreServer(const std::string& host, uint16_t port,
                 const std::optional<std::string>& token = std::nullopt);
  // The same with every setting (`options.token` as `token` above).
  TCPStoreServer(const std::string& host, uint16_t port, const TCPStoreServerOptions& options);
  ~TCPStoreServer();
  TCPStoreServer(const TCPStoreServer&) = delete;
  TCPStoreServer& operator=(const TCPStoreServer&) = delete;

  uint16_t port() const;
  const std::string& host() const;
  // Number of client connections open now.
  int num_connections() const;
  // Number of connections closed because their bytes broke the protocol (bad magic, version,
  // length, command or body) or failed the handshake (num_failed_handshakes counts those too).
  int64_t num_rejected_frames() const;
  // Number of connections closed because they did not pass the handshake in time (wrong or
  // missing token, another protocol, a stall).
  int64_t num_failed_handshakes() const;
  // Number of connections closed at accept because the server already held its limit of open
  // connections (TDIST_STORE_MAX_CONNECTIONS; by default 3/4 of the descriptor limit).
  int64_t num_refused_connections() const;
  // The most bytes of request bodies the server had taken in at once (reserved against
  // TDIST_STORE_MAX_INFLIGHT_BYTES; what is buffered never exceeds it).
  uint64_t peak_body_bytes() const;

 private:
  std::unique_ptr<detail::TCPStoreServerImpl> impl_;
};

struct TCPStoreOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;       // with is_server, 0 picks a free port (see TCPStore::port())
  bool is_server = false;  // start a TCPStoreServer in this process
  int num_workers = -1;    // when > 0, the constructor waits until that many stores joined
  Millis timeout = Store::kDefaultTimeout;  // for get/wait and for connecting
  // The shared secret of the connection handshake (client and, with is_server, server); all
  // processes of a job use the same one. Unset: TDIST_TOKEN / TDIST_TOKEN_FILE (core/token.h).
  std::optional<std::string> token;
  // With is_server: the server's limits (its token, when unset there, is `token`).
  TCPStoreServerOptions server;
};

class TCPStore : public Store {
 public:
  explicit TCPStore(TCPStoreOptions options);
  TCPStore(const std::string& host, uint16_t port, bool is_server = false,
           Millis timeout = kDefaultTimeout);
  ~TCPStore() override;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  std::string server_host() const override { return options_.host; }
  using Store::set;
  using Store::wait;

  const std::string& host() const { return options_.host; }
  uint16_t port() const { return options_.port; }
  // The server this store started (is_server), else nullptr.
  TCPStoreServer* server() const { return server_.get(); }

 private:
  // Joins the num_workers count and waits until all have joined (Note [TCPStore protocol]).
  void join();

  TCPStoreOptions options_;  // port filled in once the server is bound
  std::unique_ptr<TCPStoreServer> server_;
  std::unique_ptr<detail::TCPStoreClient> client_;
};

}  // namespace tdist
