// The TCPStore's data and the requests on it (the contract is in tcp_store_table.h).

#include "tdist/core/detail/tcp_store_table.h"

#include <algorithm>

#include "tdist/core/detail/store_util.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"

namespace tdist::detail {
namespace {

// Keys the TCPStore uses for itself (the num_workers join); num_keys() does not count them.
bool is_internal_key(const std::string& key) {
  return key.rfind(tcp_store::kInternalKeyPrefix, 0) == 0;
}

Millis read_timeout(wire::Reader& r) {
  int64_t ms = r.i64("timeout");
  if (ms < 0) throw ProtocolError(str("negative timeout ", ms, " ms"));
  return effective_timeout(Millis(ms));
}

Bytes encode_keys(const std::vector<std::string>& keys) {
  Bytes out;
  wire::Writer w(out);
  tcp_store::write_keys(w, keys);
  return out;
}

}  // namespace

StoreTable::StoreTable(asio::io_context& io, std::string address, size_t max_keys,
                       uint64_t max_bytes)
    : io_(io), address_(std::move(address)), max_keys_(max_keys), max_bytes_(max_bytes) {}

void StoreTable::handle(const std::shared_ptr<TCPStoreConnection>& conn, uint16_t code,
                        wire::Reader& body) {
  switch (static_cast<Command>(code)) {
    case Command::kSet:
      return on_set(*conn, body);
    case Command::kGet:
      return on_get(conn, body);
    case Command::kAdd:
      return on_add(*conn, body);
    case Command::kCompareSet:
      return on_compare_set(*conn, body);
    case Command::kWait:
      return on_wait(conn, body);
    case Command::kCheck:
      return on_check(*conn, body);
    case Command::kDelete:
      return on_delete(*conn, body);
    case Command::kNumKeys:
      return on_num_keys(*conn, body);
  }
  throw ProtocolError(str("unknown command ", code));
}

std::string StoreTable::write_refusal(const tcp_store::Header& header) const {
  // What a write stores is at least its body less the length prefixes; it may replace an
  // entry no larger than the largest ever stored. Beyond that it cannot fit, whatever its key.
  const auto code = static_cast<Command>(header.code);
  if (code != Command::kSet && code != Command::kCompareSet) return {};
  const uint64_t prefixes = code == Command::kSet ? 16 : 24;
  const uint64_t replaced = code == Command::kSet ? largest_entry_bytes_ : 2 * largest_entry_bytes_;
  const uint64_t room = max_bytes_ - std::min(held_bytes_, max_bytes_);
  if (header.body_bytes > prefixes && header.body_bytes - prefixes > room + replaced) {
    return str("the store at ", address_, " holds ", held_bytes_, " bytes of keys and values; ",
               "a '", tcp_store::command_name(header.code), "' of ", header.body_bytes,
               " bytes would pass its limit of ", max_bytes_,
               " (TDIST_STORE_MAX_BYTES) and is refused before its body is read");
  }
  return {};
}

void StoreTable::on_set(TCPStoreConnection& conn, wire::Reader& body) {
  std::string key = body.string("key");
  Bytes value = body.blob("value");
  body.expect_end("set request");
  if (auto why = over_limit(key, value.size()); !why.empty()) return refuse(conn, why);
  put(key, std::move(value));
  conn.reply(Status::kOk, {});
  on_key_changed(key);
}

void StoreTable::on_get(const std::shared_ptr<TCPStoreConnection>& conn, wire::Reader& body) {
  std::string key = body.string("key");
  Millis timeout = read_timeout(body);
  body.expect_end("get request");
  auto it = data_.find(key);
  if (it != data_.end()) {
    Bytes out;
    wire::Writer(out).blob(it->second);
    conn->reply(Status::kOk, out);
    return;
  }
  park(conn, Command::kGet, {key}, timeout);
}

void StoreTable::on_add(TCPStoreConnection& conn, wire::Reader& body) {
  std::string key = body.string("key");
  int64_t delta = body.i64("delta");
  body.expect_end("add request");
  int64_t value = 0;
  auto it = data_.find(key);
  try {
    if (it != data_.end()) value = parse_counter(key, it->second);
  } catch (const InvalidArgument& e) {
    return refuse(conn, e.what());
  }
  if (__builtin_add_overflow(value, delta, &value)) {
    return refuse(conn, str("add(", delta, ") overflows the counter in store key '", key, "'"));
  }
  Bytes text = to_bytes(std::to_string(value));
  if (auto why = over_limit(key, text.size()); !why.empty()) return refuse(conn, why);
  put(key, std::move(text));
  Bytes out;
  wire::Writer(out).i64(value);
  conn.reply(Status::kOk, out);
  on_key_changed(key);
}

void StoreTable::on_compare_set(TCPStoreConnection& conn, wire::Reader& body) {
  std::string key = body.string("key");
  Bytes expected = body.blob("expected");
  Bytes desired = body.blob("desired");
  body.expect_end("compare_set request");
  Bytes result;
  bool changed = false;
  auto it = data_.find(key);
  const bool swap = it == data_.end() ? expected.empty() : it->second == expected;
  if (swap) {
    if (auto why = over_limit(key, desired.size()); !why.empty()) return refuse(conn, why);
    put(key, desired);
    result = desired;
    changed = true;
  } else {
    result = it == data_.end() ? expected : it->second;
  }
  Bytes out;
  wire::Writer(out).blob(result);
  conn.reply(Status::kOk, out);
  if (changed) on_key_changed(key);
}

void StoreTable::on_wait(const std::shared_ptr<TCPStoreConnection>& conn, wire::Reader& body) {
  std::vector<std::string> keys = tcp_store::read_keys(body);
  Millis timeout = read_timeout(body);
  body.expect_end("wait request");
  if (missing_keys(keys).empty()) {
    conn->reply(Status::kOk, {});
    return;
  }
  park(conn, Command::kWait, std::move(keys), timeout);
}

void StoreTable::on_check(TCPStoreConnection& conn, wire::Reader& body) {
  std::vector<std::string> keys = tcp_store::read_keys(body);
  body.expect_end("check request");
  Bytes out;
  wire::Writer(out).u8(missing_keys(keys).empty() ? 1 : 0);
  conn.reply(Status::kOk, out);
}

void StoreTable::on_delete(TCPStoreConnection& conn, wire::Reader& body) {
  std::string key = body.string("key");
  body.expect_end("delete_key request");
  auto it = data_.find(key);
  const bool found = it != data_.end();
  if (found) {
    held_bytes_ -= key.size() + it->second.size();
    data_.erase(it);
  }
  Bytes out;
  wire::Writer(out).u8(found ? 1 : 0);
  conn.reply(Status::kOk, out);
}

void StoreTable::on_num_keys(TCPStoreConnection& conn, wire::Reader& body) {
  body.expect_end("num_keys request");
  int64_t n = 0;
  for (const auto& kv : data_)
    if (!is_internal_key(kv.first)) ++n;
  Bytes out;
  wire::Writer(out).i64(n);
  conn.reply(Status::kOk, out);
}

std::string StoreTable::over_limit(const std::string& key, size_t value_bytes) const {
  auto it = data_.find(key);
  const uint64_t freed = it == data_.end() ? 0 : key.size() + it->second.size();
  if (it == data_.end() && data_.size() >= max_keys_) {
    return str("the store at ", address_, " holds ", data_.size(), " keys, its limit ",
               "(TDIST_STORE_MAX_KEYS); setting the new key '", key, "' is refused");
  }
  if (held_bytes_ - freed + key.size() + value_bytes > max_bytes_) {
    return str("the store at ", address_, " holds ", held_bytes_, " bytes of keys and values; ",
               "storing ", value_bytes, " bytes at '", key, "' would pass its limit of ",
               max_bytes_, " (TDIST_STORE_MAX_BYTES)");
  }
  return {};
}

void StoreTable::put(const std::string& key, Bytes value) {
  auto [it, inserted] = data_.try_emplace(key);
  if (!inserted) held_bytes_ -= key.size() + it->second.size();
  held_bytes_ += key.size() + value.size();
  largest_entry_bytes_ = std::max<uint64_t>(largest_entry_bytes_, key.size() + value.size());
  it->second = std::move(value);
}

void StoreTable::refuse(TCPStoreConnection& conn, const std::string& why) {
  Bytes out;
  wire::Writer(out).string(why);
  conn.reply(Status::kInvalid, out);
}

std::vector<std::string> StoreTable::missing_keys(const std::vector<std::string>& keys) const {
  std::vector<std::string> missing;
  for (const auto& k : keys)
    if (!data_.count(k)) missing.push_back(k);
  return missing;
}

void StoreTable::park(const std::shared_ptr<TCPStoreConnection>& conn, Command cmd,
                      std::vector<std::string> keys, Millis timeout) {
  TCPStoreConnection::Waiter w;
  w.id = next_waiter_id_++;
  w.cmd = cmd;
  w.keys = std::move(keys);
  w.timeout = timeout;
  for (const auto& k : missing_keys(w.keys)) waiting_[k].insert(conn.get());
  if (timeout != Store::kNoTimeout) {
    w.timer = std::make_unique<asio::steady_timer>(io_, timeout);
    w.timer->async_wait(
        [this, conn, id = w.id](const error_code& ec) { on_wait_timeout(conn, id, ec); });
  }
  conn->waiter() = std::move(w);
}

void StoreTable::unpark(TCPStoreConnection& conn) {
  auto& waiter = conn.waiter();
  if (!waiter) return;
  for (const auto& k : waiter->keys) {
    auto it = waiting_.find(k);
    if (it == waiting_.end()) continue;
    it->second.erase(&conn);
    if (it->second.empty()) waiting_.erase(it);
  }
  if (waiter->timer) waiter->timer->cancel();
  waiter.reset();
}

void StoreTable::on_key_changed(const std::string& key) {
  auto it = waiting_.find(key);
  if (it == waiting_.end()) return;
  std::vector<TCPStoreConnection*> parked(it->second.begin(), it->second.end());
  for (TCPStoreConnection* raw : parked) {
    auto& waiter = raw->waiter();
    if (!waiter || !missing_keys(waiter->keys).empty()) continue;
    const Command cmd = waiter->cmd;
    const std::string first = waiter->keys.front();
    unpark(*raw);
    Bytes out;
    if (cmd == Command::kGet) wire::Writer(out).blob(data_.at(first));
    raw->reply(Status::kOk, out);
  }
}

void StoreTable::on_wait_timeout(const std::shared_ptr<TCPStoreConnection>& conn,
                                 uint64_t waiter_id, const error_code& ec) {
  auto& waiter = conn->waiter();
  if (ec == asio::error::operation_aborted || !waiter || waiter->id != waiter_id) return;
  std::vector<std::string> missing = missing_keys(waiter->keys);
  TDIST_LOG_DEBUG("TCPStore server ", address_, ": ",
                  tcp_store::command_name(static_cast<uint16_t>(waiter->cmd)), " from ",
                  conn->peer(), " timed out after ", seconds_text(waiter->timeout), " s; missing ",
                  join_keys(missing));
  unpark(*conn);
  conn->reply(Status::kTimeout, encode_keys(missing));
}

}  // namespace tdist::detail
