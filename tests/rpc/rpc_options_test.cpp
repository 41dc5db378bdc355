// RpcOptions resolved in one place (rpc/detail/options.h): a set field wins, an unset one takes
// its TDIST_RPC_* variable, else the default; a bad field or variable is an InvalidArgument
// naming it.
#include <gtest/gtest.h>

#include "tdist/core/error.h"
#include "tdist/rpc/detail/options.h"
#include "tests/harness/env_guard.h"

namespace tdist::rpc {
namespace {

using tdist::test::EnvGuard;

const tdist::test::EnvVars kNoVariables = {{"TDIST_RPC_HANDSHAKE_TIMEOUT_MS", std::nullopt},
                                           {"TDIST_RPC_MAX_PENDING_HANDSHAKES", std::nullopt},
                                           {"TDIST_RPC_MAX_CONNECTIONS", std::nullopt},
                                           {"TDIST_RPC_MAX_CONNECTIONS_PER_PEER", std::nullopt},
                                           {"TDIST_RPC_MAX_REQUESTS_IN_FLIGHT", std::nullopt},
                                           {"TDIST_RPC_SPIN_US", std::nullopt},
                                           {"TDIST_RPC_SHM_BYTES", std::nullopt},
                                           {"TDIST_RPC_STREAM_BYTES", std::nullopt}};

std::string error_of(const RpcOptions& o) {
  try {
    detail::resolve_options(o);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(RpcOptionsResolved, UnsetFieldsTakeTheDefaults) {
  EnvGuard env(kNoVariables);
  RpcOptions o;
  o.rpc_timeout = Millis(3000);
  const RpcOptions r = detail::resolve_options(o);
  EXPECT_EQ(r.handshake_timeout, Millis(3000));  // min(rpc_timeout, 10 s)
  EXPECT_EQ(r.max_pending_handshakes, 64);
  EXPECT_EQ(r.max_connections, 1024);
  EXPECT_EQ(r.max_connections_per_peer, 8);
  EXPECT_EQ(r.max_requests_in_flight, 1024);
  EXPECT_EQ(r.spin_us, 50);
  EXPECT_EQ(r.shm_bytes, int64_t{256} << 20);
  EXPECT_EQ(r.stream_bytes, int64_t{256} << 10);
}

TEST(RpcOptionsResolved, AVariableFillsAnUnsetFieldAndASetFieldWins) {
  EnvGuard env({{"TDIST_RPC_MAX_CONNECTIONS", std::string("17")},
                {"TDIST_RPC_SPIN_US", std::string("0")},
                {"TDIST_RPC_STREAM_BYTES", std::string("8192")},
                {"TDIST_RPC_HANDSHAKE_TIMEOUT_MS", std::string("1234")}});
  RpcOptions unset;
  const RpcOptions r = detail::resolve_options(unset);
  EXPECT_EQ(r.max_connections, 17);
  EXPECT_EQ(r.spin_us, 0);
  EXPECT_EQ(r.stream_bytes, 8192);
  EXPECT_EQ(r.handshake_timeout, Millis(1234));

  RpcOptions set;
  set.max_connections = 5;
  set.spin_us = 7;
  set.stream_bytes = 0;
  set.handshake_timeout = Millis(99);
  const RpcOptions s = detail::resolve_options(set);
  EXPECT_EQ(s.max_connections, 5);
  EXPECT_EQ(s.spin_us, 7);
  EXPECT_EQ(s.stream_bytes, 0);
  EXPECT_EQ(s.handshake_timeout, Millis(99));
}

TEST(RpcOptionsResolved, ABadFieldIsRefusedNamingIt) {
  EnvGuard env(kNoVariables);
  RpcOptions o;
  o.num_worker_threads = 0;
  EXPECT_NE(error_of(o).find("num_worker_threads"), std::string::npos);
  o = RpcOptions{};
  o.spin_us = -2;
  EXPECT_NE(error_of(o).find("spin_us"), std::string::npos);
  o = RpcOptions{};
  o.stream_bytes = 100;  // below the ring's least size
  EXPECT_NE(error_of(o).find("stream_bytes"), std::string::npos);
  o = RpcOptions{};
  o.max_connections = -1;
  EXPECT_NE(error_of(o).find("max_connections"), std::string::npos);
}

TEST(RpcOptionsResolved, ABadVariableIsRefusedNamingIt) {
  EnvGuard none(kNoVariables);
  {
    EnvGuard env({{"TDIST_RPC_MAX_REQUESTS_IN_FLIGHT", std::string("0")}});
    EXPECT_NE(error_of(RpcOptions{}).find("TDIST_RPC_MAX_REQUESTS_IN_FLIGHT"), std::string::npos);
  }
  EnvGuard env({{"TDIST_RPC_SHM_BYTES", std::string("lots")}});
  EXPECT_NE(error_of(RpcOptions{}).find("TDIST_RPC_SHM_BYTES"), std::string::npos);
}

}  // namespace
}  // namespace tdist::rpc
