#pragma once
// The TCPStore's data: the key-value map, the requests on it (set, get, add, compare_set, wait,
// check, delete_key, num_keys), the limits on what it holds (keys; bytes of keys and values
// together), and the gets and waits parked until their keys exist, each with its timer. A
// request that would pass a limit is refused with kInvalid and changes nothing; a parked
// request that times out is answered kTimeout with its missing keys (Note [TCPStore protocol]
// in core/tcp_store.cpp).
//
// Thread safety: none; only the server's io thread calls it (core/detail/tcp_store_server.h).
// It holds no connection: a parked request is the connection's Waiter, whose pointer it keeps
// until unpark().

#include <boost/asio.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tdist/core/detail/tcp_store_connection.h"
#include "tdist/core/detail/tcp_store_protocol.h"
#include "tdist/core/wire.h"

namespace tdist::detail {

class StoreTable {
 public:
  // `address` names the server in messages; timers run on `io`.
  StoreTable(asio::io_context& io, std::string address, size_t max_keys, uint64_t max_bytes);

  // Serves one request of `conn` whose body is `body`: replies at once, refuses, or parks a
  // get/wait until its keys exist. ProtocolError for a malformed body or an unknown command.
  void handle(const std::shared_ptr<TCPStoreConnection>& conn, uint16_t code, wire::Reader& body);
  // Forgets conn's parked get or wait, if any, and cancels its timer (the connection closes).
  void unpark(TCPStoreConnection& conn);
  // Why a write with this header cannot fit whatever its key ("" when it may): checked before
  // its body is read.
  std::string write_refusal(const tcp_store::Header& header) const;

 private:
  void on_set(TCPStoreConnection& conn, wire::Reader& body);
  void on_get(const std::shared_ptr<TCPStoreConnection>& conn, wire::Reader& body);
  void on_add(TCPStoreConnection& conn, wire::Reader& body);
  void on_compare_set(TCPStoreConnection& conn, wire::Reader& body);
  void on_wait(const std::shared_ptr<TCPStoreConnection>& conn, wire::Reader& body);
  void on_check(TCPStoreConnection& conn, wire::Reader& body);
  void on_delete(TCPStoreConnection& conn, wire::Reader& body);
  void on_num_keys(TCPStoreConnection& conn, wire::Reader& body);

  std::vector<std::string> missing_keys(const std::vector<std::string>& keys) const;
  // Parks a get/wait until its keys exist (or its timeout passes).
  void park(const std::shared_ptr<TCPStoreConnection>& conn, Command cmd,
            std::vector<std::string> keys, Millis timeout);
  // Answers the parked waiters that `key` completes.
  void on_key_changed(const std::string& key);
  void on_wait_timeout(const std::shared_ptr<TCPStoreConnection>& conn, uint64_t waiter_id,
                       const error_code& ec);
  // Writes go through these: why storing `value_bytes` at `key` would pass the limits on keys
  // and bytes held ("" when it fits), and the write itself (which keeps held_bytes_).
  std::string over_limit(const std::string& key, size_t value_bytes) const;
  void put(const std::string& key, Bytes value);
  // Replies kInvalid with `why` (the request is refused, the connection stays).
  static void refuse(TCPStoreConnection& conn, const std::string& why);

  // Constant after construction.
  asio::io_context& io_;
  const std::string address_;
  const size_t max_keys_;     // TDIST_STORE_MAX_KEYS
  const uint64_t max_bytes_;  // TDIST_STORE_MAX_BYTES: keys and values held, together

  std::unordered_map<std::string, Bytes> data_;
  uint64_t held_bytes_ = 0;           // sizes of data_'s keys and values
  uint64_t largest_entry_bytes_ = 0;  // the largest key + value ever stored (an upper bound)
  std::unordered_map<std::string, std::unordered_set<TCPStoreConnection*>> waiting_;
  uint64_t next_waiter_id_ = 1;
};

}  // namespace tdist::detail
