// rendezvous(init_method): every bad input is an InvalidArgument naming the value; env://, tcp://
// and file:// bring 2 ranks (threads) together over a real store.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <thread>

#include "tdist/core/error.h"
#include "tdist/core/rendezvous.h"
#include "tests/harness/env_guard.h"
#include "tests/harness/expect.h"
#include "tests/harness/net.h"
#include "tests/harness/process.h"

namespace tdist {
namespace {

using test::free_port;

using namespace std::chrono_literals;
using test::EnvGuard;

using test::kTimeout;

const test::EnvVars kCleanEnv = {
    {"RANK", std::nullopt},         {"WORLD_SIZE", std::nullopt},
    {"LOCAL_RANK", std::nullopt},   {"LOCAL_WORLD_SIZE", std::nullopt},
    {"GROUP_RANK", std::nullopt},   {"SLURM_PROCID", std::nullopt},
    {"SLURM_NTASKS", std::nullopt}, {"OMPI_COMM_WORLD_RANK", std::nullopt},
    {"MASTER_ADDR", std::nullopt},  {"MASTER_PORT", std::nullopt}};

struct BadInput {
  std::string name;
  std::string init_method;
  int rank = -1;
  int world_size = -1;
  std::string fragment;  // must appear in the message
};

std::ostream& operator<<(std::ostream& os, const BadInput& b) { return os << b.name; }

const BadInput kBadInputs[] = {
    {"UnknownScheme", "foo://host:1?rank=0&world_size=1", -1, -1, "'foo'"},
    {"NoScheme", "just-a-host:29500", -1, -1, "just-a-host:29500"},
    {"TcpMissingRank", "tcp://127.0.0.1:29500?world_size=2", -1, -1, "missing rank"},
    {"TcpMissingWorldSize", "tcp://127.0.0.1:29500?rank=0", -1, -1, "missing world_size"},
    {"TcpRankEqualsWorldSize", "tcp://127.0.0.1:29500?rank=2&world_size=2", -1, -1, "rank=2"},
    {"TcpRankNotANumber", "tcp://127.0.0.1:29500?rank=one&world_size=2", -1, -1, "'one'"},
    {"TcpWorldSizeZero", "tcp://127.0.0.1:29500?rank=0&world_size=0", -1, -1, "world_size='0'"},
    {"TcpPortNotANumber", "tcp://127.0.0.1:abc?rank=0&world_size=1", -1, -1, "'abc'"},
    {"TcpPortTooLarge", "tcp://127.0.0.1:70000?rank=0&world_size=1", -1, -1, "'70000'"},
    {"TcpPortZero", "tcp://127.0.0.1:0?rank=0&world_size=1", -1, -1, "port='0'"},
    {"TcpMissingPort", "tcp://127.0.0.1?rank=0&world_size=1", -1, -1, "missing port"},
    {"TcpMissingHost", "tcp://:29500?rank=0&world_size=1", -1, -1, "missing host"},
    {"TcpUnknownParameter", "tcp://127.0.0.1:29500?rank=0&world_size=1&color=red", -1, -1,
     "'color'"},
    {"TcpParameterWithoutValue", "tcp://127.0.0.1:29500?rank", -1, -1, "'rank'"},
    {"ArgumentRankOutOfRange", "tcp://127.0.0.1:29500", 5, 2, "rank=5"},
    {"ArgumentWorldSizeZero", "tcp://127.0.0.1:29500", 0, 0, "world_size=0"},
    {"FileRelativePath", "file://relative/path?rank=0&world_size=1", -1, -1, "'relative/path'"},
    {"FileNoPath", "file://?rank=0&world_size=1", -1, -1, "absolute path"},
    {"FileRankOutOfRange", "file:///tmp/tdist-never-created?rank=3&world_size=2", -1, -1, "rank=3"},
    {"EnvWithAnAddress", "env://127.0.0.1:29500", -1, -1, "'127.0.0.1:29500'"},
};

class RendezvousBadInput : public ::testing::TestWithParam<BadInput> {};

TEST_P(RendezvousBadInput, IsInvalidArgumentNamingTheValue) {
  EnvGuard clean(kCleanEnv);
  const BadInput& in = GetParam();
  try {
    rendezvous(in.init_method, in.rank, in.world_size, 2s);
    FAIL() << "expected InvalidArgument for " << in.init_method;
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(in.fragment), std::string::npos)
        << "'" << in.fragment << "' not in: " << msg;
    EXPECT_NE(msg.find(in.init_method), std::string::npos) << msg;
  }
  // Nothing was created for a refused file:// input.
  EXPECT_FALSE(std::filesystem::exists("/tmp/tdist-never-created"));
}

INSTANTIATE_TEST_SUITE_P(Inputs, RendezvousBadInput, ::testing::ValuesIn(kBadInputs),
                         [](const auto& info) { return info.param.name; });

template <typename Fn>
std::string invalid_message(Fn fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected InvalidArgument";
  return {};
}

TEST(Rendezvous, EnvWithoutRankNamesTheVariable) {
  EnvGuard clean(kCleanEnv);
  EnvGuard env({{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}});
  std::string msg = invalid_message([] { rendezvous("env://", -1, -1, 2s); });
  EXPECT_NE(msg.find("RANK"), std::string::npos) << msg;
}

TEST(Rendezvous, EnvWithABadMasterPortNamesTheValue) {
  EnvGuard clean(kCleanEnv);
  EnvGuard env(
      {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "abc"}, {"RANK", "0"}, {"WORLD_SIZE", "1"}});
  std::string msg = invalid_message([] { rendezvous("env://", -1, -1, 2s); });
  EXPECT_NE(msg.find("MASTER_PORT='abc'"), std::string::npos) << msg;
}

TEST(Rendezvous, EnvWithoutMasterAddrNamesTheVariable) {
  EnvGuard clean(kCleanEnv);
  EnvGuard env({{"MASTER_PORT", "29500"}, {"RANK", "0"}, {"WORLD_SIZE", "1"}});
  std::string msg = invalid_message([] { rendezvous("env://", -1, -1, 2s); });
  EXPECT_NE(msg.find("MASTER_ADDR"), std::string::npos) << msg;
}

TEST(Rendezvous, TcpBringsTwoRanksTogether) {
  const uint16_t port = free_port();
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto r = rendezvous("tcp://127.0.0.1:" + std::to_string(port) +
                                "?rank=" + std::to_string(rank) + "&world_size=2",
                            -1, -1, kTimeout);
        EXPECT_EQ(r.rank, rank);
        EXPECT_EQ(r.world_size, 2);
        r.store->set("hello/" + std::to_string(rank), std::to_string(rank + 100));
        EXPECT_EQ(r.store->get_string("hello/" + std::to_string(1 - rank)),
                  std::to_string(1 - rank + 100));
        // Rank 0 hosts the server: it leaves only after rank 1 is done with it.
        if (rank == 1) r.store->set("rank1-done", "1");
        if (rank == 0) r.store->wait({"rank1-done"});
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

TEST(Rendezvous, TcpTimesOutWhenARankNeverComes) {
  const uint16_t port = free_port();
  try {
    rendezvous("tcp://127.0.0.1:" + std::to_string(port) + "?rank=0&world_size=2", -1, -1, 500ms);
    FAIL() << "expected TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("1 of 2 joined"), std::string::npos) << e.what();
  }
}

TEST(Rendezvous, EnvBringsTwoRanksTogetherAndArgumentsWin) {
  EnvGuard clean(kCleanEnv);
  // RANK=0 in the (shared) environment; rank 1 passes its rank as an argument, which wins.
  EnvGuard env({{"MASTER_ADDR", "127.0.0.1"},
                {"MASTER_PORT", std::to_string(free_port())},
                {"RANK", "0"},
                {"WORLD_SIZE", "2"}});
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto r = rank == 0 ? rendezvous("env://", -1, -1, kTimeout)
                           : rendezvous("env://", 1, -1, kTimeout);
        EXPECT_EQ(r.rank, rank);
        EXPECT_EQ(r.world_size, 2);
        r.store->set("hello/" + std::to_string(rank), "x");
        r.store->wait({"hello/" + std::to_string(1 - rank)});
        if (rank == 1) r.store->set("rank1-done", "1");
        if (rank == 0) r.store->wait({"rank1-done"});
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

TEST(Rendezvous, FileBringsTwoRanksTogetherAndCleansUp) {
  const std::string dir = test::temp_dir("tdist-rdzv");
  const std::string path = dir + "/store";
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto r = rendezvous("file://" + path + "?world_size=2", rank, -1, kTimeout);
        EXPECT_EQ(r.rank, rank);
        EXPECT_EQ(r.world_size, 2);
        r.store->set("hello/" + std::to_string(rank), std::to_string(rank));
        EXPECT_EQ(r.store->get_string("hello/" + std::to_string(1 - rank)),
                  std::to_string(1 - rank));
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  // Both stores (num_workers = world_size) are gone: the last removed the file.
  EXPECT_FALSE(std::filesystem::exists(path));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tdist
