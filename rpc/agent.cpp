#include "tdist/rpc/agent.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "tdist/core/logging.h"
#include "tdist/core/rendezvous.h"
#include "tdist/rpc/api.h"
#include "tdist/rpc/autograd_hooks.h"

namespace tdist::rpc {

using detail::Message;

namespace {

const std::string kPrefix = "tdist_rpc/";

Millis remaining(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
  return std::max(left, Millis(1));
}

struct AddrInfo {
  addrinfo* list = nullptr;
  ~AddrInfo() {
    if (list) ::freeaddrinfo(list);
  }
};

// A connected TCP socket to host:port within `timeout`; NetworkError naming `who` otherwise.
int connect_tcp(const std::string& host, uint16_t port, Millis timeout, const std::string& who,
                int buffer_bytes) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  AddrInfo ai;
  int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &ai.list);
  if (rc != 0) {
    throw NetworkError(str("cannot resolve ", who, " at ", host, ": ", ::gai_strerror(rc)));
  }
  std::string last = "no address";
  for (addrinfo* a = ai.list; a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      last = std::strerror(errno);
      continue;
    }
    detail::set_socket_buffers(fd, buffer_bytes);
    rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      rc = ::poll(&p, 1, static_cast<int>(timeout.count() > 0 ? timeout.count() : -1));
      if (rc == 0) {
        last = str("timed out after ", timeout.count(), " ms");
        ::close(fd);
        continue;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc != 0) {
      last = std::strerror(errno);
      ::close(fd);
      continue;
    }
    int flags = ::fcntl(fd, F_GETFL);
    ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    return fd;
  }
  throw NetworkError(str("cannot connect to ", who, " at ", host, ":", port, ": ", last));
}

}  // namespace

RpcAgent::RpcAgent(const std::string& name, int rank, int world_size, RpcOptions options)
    : options_(std::move(options)) {
  TDIST_CHECK_ARG(world_size > 0, "world_size must be positive, got ", world_size);
  TDIST_CHECK_ARG(rank >= 0 && rank < world_size, "rank ", rank, " is not in [0, ", world_size,
                  ")");
  TDIST_CHECK_ARG(!name.empty(), "a worker needs a name");
  TDIST_CHECK_ARG(options_.num_worker_threads > 0, "num_worker_threads must be positive, got ",
                  options_.num_worker_threads);
  TDIST_CHECK_ARG(options_.rpc_timeout.count() >= 0, "rpc_timeout must not be negative");
  self_.name = name;
  self_.rank = rank;
  const Millis hs_timeout = options_.rpc_timeout.count() > 0
                                ? std::min(options_.rpc_timeout, Millis(60000))
                                : Millis(60000);
  conn_options_.max_frame_bytes = options_.max_frame_bytes;
  conn_options_.send_timeout = options_.rpc_timeout;
  conn_options_.handshake.token = options_.token;
  conn_options_.handshake.my_rank = rank;
  conn_options_.handshake.world_size = world_size;
  conn_options_.handshake.fast_path = options_.same_host_fast_path;
  conn_options_.handshake.timeout = hs_timeout;
  conn_options_.socket_buffer_bytes = options_.socket_buffer_bytes;
  for (int i = 0; i < world_size; ++i) peers_.push_back(std::make_unique<Peer>());
}

std::shared_ptr<RpcAgent> RpcAgent::start(const std::string& name, int rank, int world_size,
                                          RpcOptions options) {
  std::shared_ptr<RpcAgent> a(new RpcAgent(name, rank, world_size, std::move(options)));
  std::weak_ptr<RpcAgent> weak = a;
  a->rrefs_ = std::make_shared<detail::RRefContext>(weak, rank);
  a->pool_ = std::make_unique<detail::ThreadPool>(a->options_.num_worker_threads,
                                                  [weak] { detail::set_thread_agent(weak); });
  a->listen();
  a->accept_thread_ = std::thread([raw = a.get()] { raw->accept_loop(); });
  a->timeout_thread_ = std::thread([raw = a.get()] { raw->timeout_loop(); });
  try {
    a->join_group(world_size);
  } catch (...) {
    a->stop_everything("start failed");
    throw;
  }
  TDIST_LOG_INFO("rpc: worker '", name, "' (rank ", rank, " of ", world_size, ") listening on ",
                 a->options_.listen_host, ":", a->port_);
  return a;
}

RpcAgent::~RpcAgent() { stop_everything("agent destroyed"); }

void RpcAgent::listen() {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  AddrInfo ai;
  int rc = ::getaddrinfo(options_.listen_host.c_str(), std::to_string(options_.listen_port).c_str(),
                         &hints, &ai.list);
  TDIST_CHECK_ARG(rc == 0, "cannot resolve listen_host '", options_.listen_host, "': ",
                  ::gai_strerror(rc));
  std::string last = "no address";
  for (addrinfo* a = ai.list; a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    detail::set_socket_buffers(fd, options_.socket_buffer_bytes);  // accepted sockets inherit
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 512) == 0) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
      port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
      listen_fd_ = fd;
      return;
    }
    last = std::strerror(errno);
    ::close(fd);
  }
  throw NetworkError(str("worker '", self_.name, "' cannot listen on ", options_.listen_host, ":",
                         options_.listen_port, ": ", last));
}

void RpcAgent::join_group(int world_size) {
  const Millis timeout =
      options_.rpc_timeout.count() > 0 ? options_.rpc_timeout : Store::kDefaultTimeout;
  if (options_.store) {
    store_ = options_.store;
  } else {
    store_ = rendezvous(options_.init_method, self_.rank, world_size, timeout).store;
  }
  // The n-th init_rpc of each rank on one store uses keys of incarnation n, so a store that
  // served an earlier RPC group (same ranks) does not mix the two.
  const int64_t incarnation = store_->add(kPrefix + "incarnation/" + std::to_string(self_.rank), 1);
  store_prefix_ = kPrefix + std::to_string(incarnation) + "/";
  store_->set(store_prefix_ + "worker/" + std::to_string(self_.rank),
              encode(self_.name, options_.listen_host, port_));
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r) keys.push_back(store_prefix_ + "worker/" + std::to_string(r));
  try {
    store_->wait(keys, timeout);
  } catch (const TimeoutError& e) {
    throw TimeoutError(str("worker '", self_.name, "' (rank ", self_.rank, ") waited ",
                           timeout.count(), " ms for all ", world_size,
                           " RPC workers to join: ", e.what()));
  }
  for (int r = 0; r < world_size; ++r) {
    auto fields = decode<std::tuple<std::string, std::string, uint16_t>>(store_->get(keys[r]));
    WorkerInfo w{std::get<0>(fields), r};
    TDIST_CHECK_ARG(rank_by_name_.emplace(w.name, r).second, "worker name '", w.name,
                    "' is used by ranks ", rank_by_name_[w.name], " and ", r);
    workers_.push_back(w);
    addresses_.emplace_back(std::get<1>(fields), std::get<2>(fields));
  }
}

const WorkerInfo& RpcAgent::worker_info(const To& to) const {
  if (to.by_rank()) {
    TDIST_CHECK_ARG(to.rank() < static_cast<int>(workers_.size()), "no RPC worker with rank ",
                    to.rank(), " (world size ", workers_.size(), ")");
    return workers_[to.rank()];
  }
  auto it = rank_by_name_.find(to.name());
  TDIST_CHECK_ARG(it != rank_by_name_.end(), "no RPC worker named '", to.name(), "'");
  return workers_[it->second];
}

std::string RpcAgent::peer_name(int rank) const {
  if (rank >= 0 && rank < static_cast<int>(workers_.size())) {
    return str("worker '", workers_[rank].name, "' (rank ", rank, ")");
  }
  return str("worker rank ", rank);
}

void RpcAgent::accept_loop() {
  for (;;) {
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (stopped_.load()) return;
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EINVAL || errno == EBADF) return;  // the listener was shut down
      TDIST_LOG_WARN("rpc: accept failed: ", std::strerror(errno));
      std::this_thread::sleep_for(Millis(10));
      continue;
    }
    auto conn = detail::Connection::incoming(fd, conn_options_, this, pool_.get());
    std::vector<std::shared_ptr<detail::Connection>> done;
    {
      std::lock_guard<std::mutex> lock(conns_mu_);
      if (stopped_.load()) return;  // conn's destructor closes the socket
      auto it = std::partition(incoming_.begin(), incoming_.end(),
                               [](const auto& c) { return !c->finished(); });
      done.assign(std::make_move_iterator(it), std::make_move_iterator(incoming_.end()));
      incoming_.erase(it, incoming_.end());
      incoming_.push_back(conn);
    }
    for (auto& c : done) c->join();
    conn->start();
  }
}

// See RpcAgent::Peer for when a peer counts as failed.
std::shared_ptr<detail::Connection> RpcAgent::connection_to(int rank, Clock::time_point deadline) {
  Peer& p = *peers_.at(rank);
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.conn && !p.conn->closed()) return p.conn;
  if (p.conn && p.failed.empty()) {
    p.failed = str("connection to ", peer_name(rank), " was lost: ", p.conn->close_reason());
  }
  if (!p.failed.empty()) throw NetworkError(p.failed);
  Millis backoff(10);
  for (int attempt = 1;; ++attempt) {
    if (stopped_.load()) {
      throw Error(str("the RPC agent of worker '", self_.name, "' is shut down"));
    }
    try {
      p.conn = connect(rank, std::min(conn_options_.handshake.timeout, remaining(deadline)));
      return p.conn;
    } catch (const ProtocolError&) {
      throw;  // the peer refused the handshake (another token): retrying cannot help
    } catch (const Error& e) {
      if (Clock::now() + backoff >= deadline) {
        throw NetworkError(str(e.what(), " (", attempt, attempt == 1 ? " attempt" : " attempts",
                               " before the call's deadline)"));
      }
      TDIST_LOG_DEBUG("rpc: connecting to ", peer_name(rank), " failed (attempt ", attempt,
                      "), retrying in ", backoff.count(), " ms: ", e.what());
      // Sleeps in short steps so that a shutdown (which takes p.mu) is not held up.
      const auto wake = Clock::now() + backoff;
      while (Clock::now() < wake && !stopped_.load()) {
        std::this_thread::sleep_for(std::min(Millis(10), remaining(wake)));
      }
      backoff = std::min(backoff * 2, Millis(1000));
    }
  }
}

std::shared_ptr<detail::Connection> RpcAgent::connect(int rank, Millis timeout) {
  const auto& [host, port] = addresses_[rank];
  int fd = connect_tcp(host, port, timeout, peer_name(rank), conn_options_.socket_buffer_bytes);
  detail::HandshakeOptions handshake = conn_options_.handshake;
  handshake.timeout = timeout;
  detail::HandshakeResult hs;
  try {
    hs = detail::client_handshake(fd, handshake, rank);
  } catch (...) {
    ::close(fd);
    throw;
  }
  auto conn = detail::Connection::outgoing(fd, hs, conn_options_, this, pool_.get());
  conn->start();
  TDIST_LOG_DEBUG("rpc: connected to ", peer_name(rank), hs.send_remote_tensors
                                                           ? " (same-host fast path)"
                                                           : "");
  return conn;
}

void RpcAgent::send_request(int to, detail::OutMessage&& m, Millis timeout,
                            detail::ResponseFn on_done, std::string what, bool on_pool) {
  const uint64_t id = next_request_id_.fetch_add(1);
  m.id = id;
  {
    Pending p;
    p.on_done = std::move(on_done);
    p.what = std::move(what);
    p.to = to;
    p.on_pool = on_pool;
    if (timeout.count() > 0) {
      p.has_deadline = true;
      p.deadline = Clock::now() + timeout;
    }
    std::unique_lock<std::mutex> lock(pending_mu_);
    if (stopping_) {
      lock.unlock();
      auto err = std::make_exception_ptr(
          Error(str(p.what, " failed: the RPC agent of worker '", self_.name, "' is shut down")));
      complete(p, nullptr, err);
      return;
    }
    bool earliest = false;
    if (p.has_deadline) {
      earliest = deadlines_.empty() || p.deadline < deadlines_.begin()->first;
      deadlines_.emplace(p.deadline, id);
    }
    pending_.emplace(id, std::move(p));
    sent_.fetch_add(1);
    if (earliest) timeout_cv_.notify_one();
  }
  try {
    if (auto* hooks = detail::autograd_hooks()) hooks->on_send_request(*this, to, m);
    // A call without a timeout still gives up connecting after one handshake timeout.
    connection_to(to, timeout.count() > 0 ? Clock::now() + timeout
                                          : Clock::now() + conn_options_.handshake.timeout)
        ->send(std::move(m));
  } catch (const std::exception& e) {
    Pending p;
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      auto it = pending_.find(id);
      if (it == pending_.end()) return;  // already failed by the connection's close
      p = std::move(it->second);
      pending_.erase(it);
      if (p.has_deadline) deadlines_.erase({p.deadline, id});
      sent_.fetch_sub(1);
      ++processing_;
    }
    std::exception_ptr err;
    if (dynamic_cast<const InvalidArgument*>(&e)) {
      err = std::current_exception();
    } else {
      err = std::make_exception_ptr(NetworkError(str(p.what, " failed: ", e.what())));
    }
    complete(p, nullptr, err);
  }
}

void RpcAgent::complete(Pending& p, Message* msg, std::exception_ptr error) {
  try {
    p.on_done(msg, std::move(error));
  } catch (const std::exception& e) {
    TDIST_LOG_ERROR("rpc: completion of ", p.what, " threw: ", e.what());
  }
  p.on_done = nullptr;
  std::lock_guard<std::mutex> lock(pending_mu_);
  if (--processing_ == 0 && pending_.empty()) idle_cv_.notify_all();
}

void RpcAgent::post_work(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    if (stopping_) return;
    ++processing_;
  }
  auto done = [this] {
    std::lock_guard<std::mutex> lock(pending_mu_);
    if (--processing_ == 0 && pending_.empty()) idle_cv_.notify_all();
  };
  std::function<void()> task = [this, fn = std::move(fn), done] {
    try {
      fn();
    } catch (const std::exception& e) {
      TDIST_LOG_ERROR("rpc: worker '", self_.name, "': posted work threw: ", e.what());
    }
    done();
  };
  if (!pool_->try_post(std::move(task))) done();
}

void RpcAgent::schedule(Clock::time_point when, std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    if (stopping_) return;
    const bool earliest = timers_.empty() || when < timers_.begin()->first;
    timers_.emplace(when, std::move(fn));
    if (!earliest) return;
  }
  timeout_cv_.notify_one();
}

bool RpcAgent::idle() const {
  std::lock_guard<std::mutex> lock(pending_mu_);
  return pending_.empty() && processing_ == 0;
}

size_t RpcAgent::num_pending() const {
  std::lock_guard<std::mutex> lock(pending_mu_);
  return pending_.size();
}

void RpcAgent::on_message(const std::shared_ptr<detail::Connection>& conn, Message&& msg) {
  if (detail::is_request(msg.type)) {
    received_.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      ++processing_;
    }
    bool posted = pool_->try_post([this, conn, m = std::move(msg)]() mutable {
      std::shared_ptr<void> autograd_scope;  // see rpc/autograd_hooks.h
      bool ok = true;
      if (m.flags & detail::kFlagAutograd) {
        try {
          auto* hooks = detail::autograd_hooks();
          if (!hooks) throw ProtocolError("an autograd frame reached a worker without autograd");
          autograd_scope = hooks->on_recv_request(*this, m);
        } catch (const std::exception& e) {
          ok = false;
          reply_error(conn, m.id, e.what());
        }
      }
      if (ok) handle_request(conn, m);
      autograd_scope.reset();
      std::lock_guard<std::mutex> lock(pending_mu_);
      if (--processing_ == 0 && pending_.empty()) idle_cv_.notify_all();
    });
    if (!posted) {
      std::lock_guard<std::mutex> lock(pending_mu_);
      --processing_;
    }
    return;
  }
  Pending p;
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    auto it = pending_.find(msg.id);
    if (it == pending_.end()) {
      TDIST_LOG_DEBUG("rpc: dropping a response to request ", msg.id, " from ",
                      peer_name(msg.from), " (timed out or already failed)");
      return;
    }
    p = std::move(it->second);
    pending_.erase(it);
    if (p.has_deadline) deadlines_.erase({p.deadline, msg.id});
    ++processing_;
  }
  std::exception_ptr error;
  if (msg.type == detail::MessageType::kError) {
    try {
      auto body = decode<detail::ErrorBody>(msg.body);
      error = std::make_exception_ptr(RemoteError(
          str(p.what, " failed on worker '", body.worker, "': ", body.message), body.worker,
          body.message));
    } catch (const std::exception& e) {
      error = std::make_exception_ptr(
          ProtocolError(str(p.what, " failed with an unreadable error: ", e.what())));
    }
  }
  if (!error && (msg.flags & detail::kFlagAutograd)) {  // see rpc/autograd_hooks.h
    try {
      auto* hooks = detail::autograd_hooks();
      if (!hooks) throw ProtocolError("an autograd frame reached a worker without autograd");
      hooks->on_recv_response(*this, msg);
    } catch (const std::exception& e) {
      error = std::make_exception_ptr(
          ProtocolError(str(p.what, " failed: bad autograd response: ", e.what())));
    }
  }
  if (p.on_pool || (msg.flags & detail::kFlagHasRRefs)) {
    auto shared = std::make_shared<std::pair<Pending, Message>>(std::move(p), std::move(msg));
    bool posted = pool_->try_post([this, shared, error] {
      complete(shared->first, &shared->second, error);
    });
    if (!posted) complete(shared->first, &shared->second, error);
    return;
  }
  complete(p, &msg, error);
}

void RpcAgent::on_closed(const std::shared_ptr<detail::Connection>& conn,
                         const std::string& reason) {
  const int rank = conn->peer_rank();
  if (rank < 0) {
    if (!stopped_.load()) TDIST_LOG_WARN("rpc: rejected a connection: ", reason);
    return;
  }
  if (!stopped_.load()) {
    std::lock_guard<std::mutex> lock(lost_mu_);
    lost_.insert(rank);  // see Note [RPC graceful shutdown]
  }
  if (!conn->is_outgoing()) {
    if (!stopped_.load() && !reason.empty()) {
      TDIST_LOG_DEBUG("rpc: connection from ", peer_name(rank), " closed: ", reason);
    }
    return;
  }
  {
    Peer& p = *peers_.at(rank);
    std::lock_guard<std::mutex> lock(p.mu);
    if (p.conn == conn && p.failed.empty()) {
      p.failed = str("connection to ", peer_name(rank), " was lost: ", reason);
    }
  }
  fail_pending_to(rank, reason);
}

void RpcAgent::fail_pending_to(int rank, const std::string& reason) {
  std::vector<Pending> failed;
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->second.to == rank) {
        if (it->second.has_deadline) deadlines_.erase({it->second.deadline, it->first});
        failed.push_back(std::move(it->second));
        it = pending_.erase(it);
        ++processing_;
      } else {
        ++it;
      }
    }
  }
  if (failed.empty()) return;
  TDIST_LOG_WARN("rpc: connection to ", peer_name(rank), " lost (", reason, "); failing ",
                 failed.size(), " pending calls");
  for (auto& p : failed) {
    auto err = std::make_exception_ptr(
        NetworkError(str(p.what, " failed: connection to ", peer_name(rank), " lost: ", reason)));
    auto shared = std::make_shared<Pending>(std::move(p));
    if (!pool_->try_post([this, shared, err] { complete(*shared, nullptr, err); })) {
      complete(*shared, nullptr, err);
    }
  }
}

void RpcAgent::timeout_loop() {
  std::unique_lock<std::mutex> lock(pending_mu_);
  while (!stopping_) {
    if (!timers_.empty() && timers_.begin()->first <= Clock::now()) {
      auto fn = std::move(timers_.begin()->second);
      timers_.erase(timers_.begin());
      lock.unlock();
      post_work(std::move(fn));
      lock.lock();
      continue;
    }
    if (deadlines_.empty()) {
      if (timers_.empty()) {
        timeout_cv_.wait(lock);
      } else {
        timeout_cv_.wait_until(lock, timers_.begin()->first);
      }
      continue;
    }
    auto [deadline, id] = *deadlines_.begin();
    if (Clock::now() < deadline) {
      auto until = deadline;
      if (!timers_.empty()) until = std::min(until, timers_.begin()->first);
      timeout_cv_.wait_until(lock, until);
      continue;
    }
    deadlines_.erase(deadlines_.begin());
    auto it = pending_.find(id);
    if (it == pending_.end()) continue;
    Pending p = std::move(it->second);
    pending_.erase(it);
    ++processing_;
    lock.unlock();
    auto err = std::make_exception_ptr(TimeoutError(str(
        p.what, " timed out: no answer from ", peer_name(p.to), " within the call's timeout")));
    complete(p, nullptr, err);
    lock.lock();
  }
}

bool RpcAgent::wait_idle(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(pending_mu_);
  return idle_cv_.wait_until(lock, deadline,
                             [&] { return pending_.empty() && processing_ == 0; });
}

void RpcAgent::publish_lost_peers() {
  std::vector<int> fresh;
  {
    std::lock_guard<std::mutex> lock(lost_mu_);
    for (int r : lost_) {
      if (lost_published_.insert(r).second) fresh.push_back(r);
    }
  }
  for (int r : fresh) {
    // A worker that finished its shutdown closes its connections too: not gone, just left.
    if (store_->check({store_prefix_ + "shutdown/exit/" + std::to_string(r)})) continue;
    TDIST_LOG_WARN("rpc: shutdown: worker '", self_.name, "' lost its connection to ",
                   peer_name(r), "; the other workers' shutdown will not wait for it");
    store_->set(store_prefix_ + "shutdown/gone/" + std::to_string(r), "1");
  }
}

std::vector<bool> RpcAgent::wait_for_workers(const std::string& prefix, int first_rank,
                                             Clock::time_point deadline) {
  static constexpr Millis kPoll{100};
  const int n = world_size();
  const std::string gone = store_prefix_ + "shutdown/gone/";
  std::vector<bool> present(n, false), resolved(n, false);
  for (int r = 0; r < first_rank; ++r) resolved[r] = true;
  for (;;) {
    std::vector<std::string> missing;
    for (int r = 0; r < n; ++r) {
      if (!resolved[r]) missing.push_back(prefix + std::to_string(r));
    }
    try {
      store_->wait(missing, std::min(kPoll, remaining(deadline)));
      for (int r = first_rank; r < n; ++r) present[r] = present[r] || !resolved[r];
      return present;
    } catch (const TimeoutError&) {
      if (Clock::now() >= deadline) {
        std::string who;
        for (int r = first_rank; r < n; ++r) {
          if (!resolved[r]) who += (who.empty() ? "" : ", ") + peer_name(r);
        }
        throw TimeoutError(str("no key ", prefix, "<rank> from ", who,
                               ", and none of them was seen gone"));
      }
    }
    publish_lost_peers();
    for (int r = first_rank; r < n; ++r) {
      if (resolved[r]) continue;
      const std::string key = prefix + std::to_string(r);
      if (store_->check({key})) {
        present[r] = resolved[r] = true;
      } else if (store_->check({gone + std::to_string(r)})) {
        // Whatever it set, it set before it was seen gone: one more look decides for good.
        resolved[r] = true;
        present[r] = store_->check({key});
      }
    }
    if (store_->check({gone + std::to_string(self_.rank)})) {
      throw Error(str("worker '", self_.name, "' was declared gone by another worker (a "
                      "connection to it broke) while it was still shutting down"));
    }
  }
}

void RpcAgent::graceful_barrier() {
  const Millis limit =
      options_.shutdown_timeout.count() > 0 ? options_.shutdown_timeout : Millis(1LL << 40);
  const auto deadline = Clock::now() + limit;
  const int n = world_size();
  std::vector<std::pair<int64_t, int64_t>> prev;
  for (int round = 0;; ++round) {
    // Round 0 told everybody that this worker is shutting down; from round 1 on, every worker
    // is, and what they still hold is deleted (Note [RPC graceful shutdown]).
    if (round > 0) rrefs_->delete_all_users();
    if (!wait_idle(deadline)) {
      std::string what;
      {
        std::lock_guard<std::mutex> lock(pending_mu_);
        int shown = 0;
        for (const auto& [id, p] : pending_) {
          if (shown++ == 3) break;
          what += (what.empty() ? "" : "; ") + p.what;
        }
        what = str(pending_.size(), " calls pending (", what, "), ", processing_,
                   " incoming calls running");
      }
      throw TimeoutError(str("shutdown of worker '", self_.name, "' waited ", limit.count(),
                             " ms for its own work to finish: ", what));
    }
    const std::string round_prefix = store_prefix_ + "shutdown/" + std::to_string(round) + "/";
    store_->set(round_prefix + std::to_string(self_.rank),
                encode(sent_.load(), received_.load()));
    std::vector<bool> present;
    try {
      present = wait_for_workers(round_prefix, 0, deadline);
    } catch (const TimeoutError& e) {
      throw TimeoutError(str("shutdown of worker '", self_.name, "' waited ", limit.count(),
                             " ms for the other workers to shut down (round ", round, "): ",
                             e.what()));
    }
    // A gone worker that never published this round counts as (-1, -1) for everybody alike.
    std::vector<std::pair<int64_t, int64_t>> counts(n, {-1, -1});
    for (int r = 0; r < n; ++r) {
      if (present[r]) {
        counts[r] = decode<std::pair<int64_t, int64_t>>(store_->get(round_prefix + std::to_string(r)));
      }
    }
    if (round > 0 && counts == prev) break;
    prev = std::move(counts);
  }
  // The store may live in one of the workers (TCPStore server): leave only when every worker
  // has read the last round.
  store_->set(store_prefix_ + "shutdown/exit/" + std::to_string(self_.rank), "1");
  wait_for_workers(store_prefix_ + "shutdown/exit/", 0, deadline);
  // Rank 0 usually hosts that store (env://): it stays until every other worker's wait above
  // has returned, or an exiting rank 0 could cut another worker's wait off mid-reply. The others'
  // last store call is the "left" mark; its own reply may be cut off, which is harmless.
  const std::string left = store_prefix_ + "shutdown/left/";
  if (self_.rank == 0) {
    try {
      wait_for_workers(left, 1, deadline);
    } catch (const std::exception& e) {
      TDIST_LOG_WARN("rpc: shutdown: not every worker confirmed it left the store: ", e.what());
    }
  } else {
    try {
      store_->set(left + std::to_string(self_.rank), "1");
    } catch (const std::exception&) {
    }
  }
}

void RpcAgent::shutdown(bool graceful) {
  TDIST_CHECK_ARG(!(graceful && pool_ && pool_->in_pool_thread()),
                  "shutdown() of worker '", self_.name, "' called on one of its own worker "
                  "threads (from a function called over RPC): it would wait for that very call; "
                  "shut down from the program's own thread");
  std::lock_guard<std::mutex> guard(shutdown_mu_);
  if (stopped_.load()) return;
  std::exception_ptr error;
  if (graceful) {
    try {
      graceful_barrier();
    } catch (...) {
      error = std::current_exception();
    }
  }
  auto leaks = rrefs_->registered();
  if (!leaks.empty()) {
    TDIST_LOG_WARN("rpc: worker '", self_.name, "' shuts down with ", leaks.size(),
                   " RRefs still referenced (leaked):");
    for (const auto& l : leaks) TDIST_LOG_WARN("rpc:   ", l);
  }
  {
    std::lock_guard<std::mutex> lock(leaks_mu_);
    leaked_ = std::move(leaks);
  }
  stop_everything(graceful ? "shut down" : "shut down without waiting");
  if (error) std::rethrow_exception(error);
}

std::vector<std::string> RpcAgent::leaked_rrefs() const {
  std::lock_guard<std::mutex> lock(leaks_mu_);
  return leaked_;
}

void RpcAgent::stop_everything(const std::string& reason) {
  std::vector<Pending> failed;
  std::multimap<Clock::time_point, std::function<void()>> timers;  // dropped outside the lock
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    if (stopping_ && stopped_.load()) return;
    stopping_ = true;
    stopped_ = true;
    for (auto& [id, p] : pending_) failed.push_back(std::move(p));
    pending_.clear();
    deadlines_.clear();
    timers.swap(timers_);
    processing_ += static_cast<int64_t>(failed.size());
  }
  timeout_cv_.notify_all();
  for (auto& p : failed) {
    complete(p, nullptr,
             std::make_exception_ptr(Error(str(p.what, " failed: worker '", self_.name,
                                               "' ", reason, " before it finished"))));
  }
  if (listen_fd_ >= 0) ::shutdown(listen_fd_, SHUT_RDWR);
  if (accept_thread_.joinable()) accept_thread_.join();
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
  std::vector<std::shared_ptr<detail::Connection>> conns;
  for (auto& p : peers_) {
    std::lock_guard<std::mutex> lock(p->mu);
    if (p->conn) conns.push_back(p->conn);
    if (p->failed.empty()) p->failed = str("the RPC agent of worker '", self_.name, "' ", reason);
  }
  {
    std::lock_guard<std::mutex> lock(conns_mu_);
    for (auto& c : incoming_) conns.push_back(c);
  }
  for (auto& c : conns) c->close(reason);
  for (auto& c : conns) c->join();
  if (pool_) pool_->stop();
  if (timeout_thread_.joinable()) timeout_thread_.join();
  {
    std::lock_guard<std::mutex> lock(conns_mu_);
    incoming_.clear();
  }
  for (auto& p : peers_) {
    std::lock_guard<std::mutex> lock(p->mu);
    p->conn.reset();
  }
}

}  // namespace tdist::rpc
