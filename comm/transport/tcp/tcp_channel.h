#pragma once
// TcpChannel: a Channel over a mesh connection (not owned); see channel.h.

#include "tdist/comm/transport/channel.h"
#include "tdist/comm/transport/tcp/connection.h"

namespace tdist::comm::tcp {

class TcpChannel final : public Channel {
 public:
  explicit TcpChannel(Connection* conn) : conn_(conn) {}
  int peer() const override { return conn_->peer(); }
  const char* kind() const override { return "tcp"; }
  long writev(const iovec* iov, int count) override { return conn_->writev(iov, count); }
  long readv(const iovec* iov, int count) override { return conn_->readv(iov, count); }
  bool prepare_wait(bool want_read, bool want_write, pollfd& pfd) override {
    pfd = pollfd{conn_->fd(),
                 static_cast<short>((want_read ? POLLIN : 0) | (want_write ? POLLOUT : 0)), 0};
    return true;
  }
  void after_wait(short) override {}
  void shutdown() override { conn_->shutdown(); }

 private:
  Connection* const conn_;
};

}  // namespace tdist::comm::tcp
