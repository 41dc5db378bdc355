#include "tdist/core/rendezvous.h"

#include <map>
#include <optional>

#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/file_store.h"
#include "tdist/core/logging.h"
#include "tdist/core/tcp_store.h"

namespace tdist {
namespace {

constexpr int64_t kMaxRanks = 1 << 24;

// Every rendezvous error names the init_method it came from.
[[noreturn]] void bad(const std::string& init_method, const std::string& what) {
  throw InvalidArgument(str("rendezvous: ", what, " (init_method '", init_method, "')"));
}

// scheme://rest?query
struct Url {
  std::string scheme;
  std::string rest;
  std::map<std::string, std::string> query;
};

Url parse_url(const std::string& init_method) {
  Url url;
  const auto sep = init_method.find("://");
  if (sep == std::string::npos || sep == 0) {
    bad(init_method, "no scheme; expected env://, tcp://host:port or file:///path");
  }
  url.scheme = init_method.substr(0, sep);
  std::string after = init_method.substr(sep + 3);
  const auto q = after.find('?');
  url.rest = after.substr(0, q);
  if (q == std::string::npos) return url;
  std::string query = after.substr(q + 1);
  size_t pos = 0;
  while (pos <= query.size()) {
    size_t amp = query.find('&', pos);
    std::string item = query.substr(pos, amp == std::string::npos ? std::string::npos : amp - pos);
    pos = amp == std::string::npos ? query.size() + 1 : amp + 1;
    if (item.empty()) continue;
    const auto eq = item.find('=');
    if (eq == std::string::npos) bad(init_method, str("query item '", item, "' is not name=value"));
    std::string name = item.substr(0, eq);
    if (name != "rank" && name != "world_size") {
      bad(init_method, str("unknown query parameter '", name, "' (expected rank or world_size)"));
    }
    if (!url.query.emplace(name, item.substr(eq + 1)).second) {
      bad(init_method, str("query parameter '", name, "' is given twice"));
    }
  }
  return url;
}

// An integer from the URL, with the init_method added to parse errors.
int parse_param(const std::string& init_method, const std::string& name, const std::string& value,
                int64_t min, int64_t max) {
  try {
    return static_cast<int>(env::parse_int(name, value, min, max));
  } catch (const InvalidArgument& e) {
    bad(init_method, e.what());
  }
}

struct RankAndSize {
  int rank = -1;
  int world_size = -1;
};

// Arguments (>= 0) first, then the URL's query, then (env:// only) the environment.
RankAndSize resolve_rank(const std::string& init_method, const Url& url, int rank, int world_size,
                         bool from_env) {
  RankAndSize out;
  if (world_size == 0 || world_size < -1) {
    bad(init_method, str("world_size=", world_size, " must be at least 1"));
  }
  if (rank < -1) bad(init_method, str("rank=", rank, " must be at least 0"));
  out.world_size = world_size;
  out.rank = rank;
  if (out.world_size < 0 && url.query.count("world_size")) {
    out.world_size =
        parse_param(init_method, "world_size", url.query.at("world_size"), 1, kMaxRanks);
  }
  if (out.rank < 0 && url.query.count("rank")) {
    out.rank = parse_param(init_method, "rank", url.query.at("rank"), 0, kMaxRanks);
  }
  if ((out.rank < 0 || out.world_size < 0) && from_env) {
    env::DistEnv e;
    try {
      e = env::read_dist_env();
    } catch (const InvalidArgument& err) {
      bad(init_method, err.what());
    }
    if (out.rank < 0) out.rank = e.rank;
    if (out.world_size < 0) out.world_size = e.world_size;
  }
  if (out.world_size < 0) bad(init_method, "missing world_size (add ?world_size=N or pass it)");
  if (out.rank < 0) bad(init_method, "missing rank (add ?rank=R or pass it)");
  if (out.rank >= out.world_size) {
    bad(init_method, str("rank=", out.rank, " is out of range for world_size=", out.world_size,
                         " (ranks are 0..", out.world_size - 1, ")"));
  }
  return out;
}

struct HostPort {
  std::string host;
  uint16_t port = 0;
};

// host:port or [v6-address]:port.
HostPort parse_host_port(const std::string& init_method, const std::string& authority) {
  HostPort hp;
  std::string port_text;
  if (!authority.empty() && authority.front() == '[') {
    const auto close = authority.find(']');
    if (close == std::string::npos) bad(init_method, str("unclosed '[' in '", authority, "'"));
    hp.host = authority.substr(1, close - 1);
    if (close + 1 < authority.size()) {
      if (authority[close + 1] != ':')
        bad(init_method, str("expected ':' after ']' in '", authority, "'"));
      port_text = authority.substr(close + 2);
    } else {
      bad(init_method, str("missing port in '", authority, "' (expected tcp://host:port)"));
    }
  } else {
    const auto colon = authority.rfind(':');
    if (colon == std::string::npos) {
      bad(init_method, str("missing port in '", authority, "' (expected tcp://host:port)"));
    }
    hp.host = authority.substr(0, colon);
    port_text = authority.substr(colon + 1);
  }
  if (hp.host.empty()) bad(init_method, "missing host (expected tcp://host:port)");
  hp.port = static_cast<uint16_t>(parse_param(init_method, "port", port_text, 1, 65535));
  return hp;
}

std::shared_ptr<Store> tcp_store(const HostPort& hp, const RankAndSize& rs, Millis timeout) {
  TCPStoreOptions opts;
  opts.host = hp.host;
  opts.port = hp.port;
  opts.is_server = rs.rank == 0;
  opts.num_workers = rs.world_size;  // the constructor returns once every rank has joined
  opts.timeout = timeout;
  return std::make_shared<TCPStore>(opts);
}

}  // namespace

RendezvousResult rendezvous(const std::string& init_method, int rank, int world_size,
                            Millis timeout) {
  const Url url = parse_url(init_method);
  RendezvousResult result;
  if (url.scheme == "env") {
    if (!url.rest.empty()) bad(init_method, str("env:// takes no address, got '", url.rest, "'"));
    // Checked before the environment is read, so an argument error is reported as such.
    RankAndSize rs = resolve_rank(init_method, url, rank, world_size, /*from_env=*/true);
    env::MasterAddress master;
    try {
      master = env::read_master_address();
    } catch (const InvalidArgument& e) {
      bad(init_method, e.what());
    }
    result.store = tcp_store({master.host, master.port}, rs, timeout);
    result.rank = rs.rank;
    result.world_size = rs.world_size;
  } else if (url.scheme == "tcp") {
    HostPort hp = parse_host_port(init_method, url.rest);
    RankAndSize rs = resolve_rank(init_method, url, rank, world_size, /*from_env=*/false);
    result.store = tcp_store(hp, rs, timeout);
    result.rank = rs.rank;
    result.world_size = rs.world_size;
  } else if (url.scheme == "file") {
    if (url.rest.empty() || url.rest.front() != '/') {
      bad(init_method, str("file:// needs an absolute path (file:///path), got '", url.rest, "'"));
    }
    RankAndSize rs = resolve_rank(init_method, url, rank, world_size, /*from_env=*/false);
    result.store = std::make_shared<FileStore>(url.rest, rs.world_size, timeout);
    result.rank = rs.rank;
    result.world_size = rs.world_size;
  } else {
    bad(init_method, str("unknown scheme '", url.scheme, "' (expected env, tcp or file)"));
  }
  TDIST_LOG_DEBUG("rendezvous ", init_method, ": rank ", result.rank, " of ", result.world_size);
  return result;
}

}  // namespace tdist
