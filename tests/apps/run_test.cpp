// tdist-run as a user runs it: real worker processes (small shell scripts), real signals.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <thread>

#include "tdist/core/env.h"
#include "tests/apps/programs.h"
#include "tests/harness/command.h"
#include "tests/harness/expect.h"
#include "tests/harness/net.h"
#include "tests/harness/process.h"

namespace tdist {
namespace {

using test::CommandOptions;
using test::run_command;

using test::contains;
using test::kRun;
using test::with_timeout;

test::CommandResult launch(std::vector<std::string> args, CommandOptions opts = {}) {
  args.insert(args.begin(), kRun);
  return run_command(args, opts);
}

TEST(TdistRun, WorkersSeeTheirVariables) {
  auto r = launch({"--nproc-per-node", "3", "--master-port", "0", "sh", "-c",
                   "echo vars $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK "
                   "$MASTER_ADDR $MASTER_PORT $TDIST_RESTART_COUNT $OMP_NUM_THREADS"});
  ASSERT_TRUE(r.exited && r.exit_code == 0) << r.describe();
  std::regex line(R"(\[rank (\d)\] vars (\d) (\d) 3 3 0 127\.0\.0\.1 (\d+) 0 1)");
  std::map<int, int> seen;
  std::string port;
  std::istringstream in(r.out);
  for (std::string l; std::getline(in, l);) {
    std::smatch m;
    if (std::regex_match(l, m, line)) {
      EXPECT_EQ(m[1], m[2]) << l;  // the prefix is the worker's own RANK
      EXPECT_EQ(m[2], m[3]) << l;  // single node: LOCAL_RANK == RANK
      if (port.empty()) port = m[4];
      EXPECT_EQ(port, m[4]) << "every worker gets the same MASTER_PORT";
      seen[std::stoi(m[1])]++;
    }
  }
  EXPECT_EQ(seen, (std::map<int, int>{{0, 1}, {1, 1}, {2, 1}})) << r.describe();
  EXPECT_NE(port, "0") << "port 0 means: pick a free one";
}

// The token each worker saw, by rank ("" when unset), from `echo token=$TDIST_TOKEN` lines.
std::map<int, std::string> tokens_seen(const std::string& out) {
  std::map<int, std::string> seen;
  std::regex line(R"(\[rank (\d)\] token=(\S*) file=(\S*))");
  std::istringstream in(out);
  for (std::string l; std::getline(in, l);) {
    std::smatch m;
    if (std::regex_match(l, m, line)) seen[std::stoi(m[1])] = m[2].str() + "|" + m[3].str();
  }
  return seen;
}

const std::vector<std::string> kPrintToken = {"sh", "-c",
                                              "echo token=$TDIST_TOKEN file=$TDIST_TOKEN_FILE"};

std::vector<std::string> with_command(std::vector<std::string> args,
                                      const std::vector<std::string>& command) {
  args.insert(args.end(), command.begin(), command.end());
  return args;
}

// Note [Launcher token]: a single-node job draws its own token, the same for all its workers
// and new per run; one the user set is passed on untouched.
TEST(TdistRun, ASingleNodeJobGetsItsOwnRandomToken) {
  CommandOptions o;
  o.env = {{"TDIST_TOKEN", ""}, {"TDIST_TOKEN_FILE", ""}};
  const auto args = with_command({"--nproc-per-node", "2", "--master-port", "0"}, kPrintToken);
  auto first = launch(args, o);
  auto second = launch(args, o);
  ASSERT_EQ(first.exit_code, 0) << first.describe();
  ASSERT_EQ(second.exit_code, 0) << second.describe();
  auto a = tokens_seen(first.out);
  auto b = tokens_seen(second.out);
  ASSERT_EQ(a.size(), 2u) << first.out;
  ASSERT_EQ(b.size(), 2u) << second.out;
  EXPECT_EQ(a[0], a[1]) << "the workers of one job share its token";
  EXPECT_TRUE(std::regex_match(a[0], std::regex("[0-9a-f]{64}\\|"))) << a[0];
  EXPECT_NE(a[0], b[0]) << "each run draws a new token";
  o.env["TDIST_TOKEN"] = "mine";
  auto given = launch(args, o);
  EXPECT_EQ(tokens_seen(given.out)[1], "mine|") << given.describe();
}

TEST(TdistRun, TokenFileIsCheckedThenPassedOnByPath) {
  const std::string path = test::temp_dir() + "/token";
  std::ofstream(path) << "s3cret\n";
  CommandOptions o;
  o.env = {{"TDIST_TOKEN", ""}, {"TDIST_TOKEN_FILE", ""}};
  ::chmod(path.c_str(), 0644);
  const auto args = with_command(
      {"--nproc-per-node", "2", "--master-port", "0", "--token-file", path}, kPrintToken);
  auto open = launch(args, o);
  EXPECT_EQ(open.exit_code, 2) << open.describe();
  EXPECT_TRUE(contains(open.err, "--token-file: TDIST_TOKEN_FILE='" + path + "' has mode 0644"))
      << open.err;
  EXPECT_TRUE(tokens_seen(open.out).empty()) << "no worker starts with a bad token file";
  ::chmod(path.c_str(), 0600);
  auto ok = launch(args, o);
  ASSERT_EQ(ok.exit_code, 0) << ok.describe();
  EXPECT_EQ(tokens_seen(ok.out), (std::map<int, std::string>{{0, "|" + path}, {1, "|" + path}}))
      << "the secret itself stays out of the environment";
  o.env["TDIST_TOKEN"] = "also";
  auto both = launch(args, o);
  EXPECT_EQ(both.exit_code, 2) << both.describe();
  EXPECT_TRUE(contains(both.err, "give only one")) << both.err;
}

TEST(TdistRun, AMultiNodeJobWithoutATokenWarnsNamingItsStore) {
  CommandOptions o;
  o.env = {{"TDIST_TOKEN", ""}, {"TDIST_TOKEN_FILE", ""}};
  const auto args = with_command(
      {"--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", "29998"},
      kPrintToken);
  auto r = launch(args, o);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_TRUE(contains(r.err, "warning: this multi-node job has no token")) << r.err;
  EXPECT_TRUE(contains(r.err, "the store at 127.0.0.1:29998")) << r.err;
  EXPECT_EQ(tokens_seen(r.out)[1], "|") << "nodes do not draw tokens of their own";
  o.env["TDIST_TOKEN"] = "shared";
  auto quiet = launch(args, o);
  EXPECT_FALSE(contains(quiet.err, "no token")) << quiet.err;
}

TEST(TdistRun, MultiNodeRanksFollowTheNodeRank) {
  auto r = launch({"--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--master-addr",
                   "127.0.0.1", "--master-port", "29999", "sh", "-c",
                   "echo vars $RANK $LOCAL_RANK $WORLD_SIZE $GROUP_RANK $MASTER_PORT"});
  ASSERT_TRUE(r.exited && r.exit_code == 0) << r.describe();
  EXPECT_TRUE(contains(r.out, "[rank 2] vars 2 0 4 1 29999")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 3] vars 3 1 4 1 29999")) << r.out;
}

TEST(TdistRun, AFailingWorkerStopsTheOthers) {
  std::string dir = test::temp_dir();
  auto r = launch({"--nproc-per-node", "3", "--master-port", "0", "--stop-grace", "2", "sh", "-c",
                   "if [ $RANK = 1 ]; then echo boom >&2; exit 3; fi; sleep 60; touch " + dir +
                       "/survived_$RANK"},
                  with_timeout(40));
  ASSERT_FALSE(r.timed_out) << r.describe();
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_TRUE(contains(r.err, "rank 1")) << r.err;
  EXPECT_TRUE(contains(r.err, "exited with code 3")) << r.err;
  EXPECT_TRUE(contains(r.err, "boom")) << "the last stderr lines are reported: " << r.err;
  EXPECT_NE(access((dir + "/survived_0").c_str(), F_OK), 0) << "rank 0 was not stopped";
  EXPECT_NE(access((dir + "/survived_2").c_str(), F_OK), 0) << "rank 2 was not stopped";
}

TEST(TdistRun, AWorkerKilledBySignalIsNamed) {
  auto r = launch({"--nproc-per-node", "2", "--master-port", "0", "sh", "-c",
                   "if [ $RANK = 0 ]; then kill -9 $$; fi; sleep 60"},
                  with_timeout(40));
  ASSERT_FALSE(r.timed_out) << r.describe();
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_TRUE(contains(r.err, "rank 0")) << r.err;
  EXPECT_TRUE(contains(r.err, "SIGKILL")) << r.err;
}

TEST(TdistRun, WorkersThatIgnoreSigtermAreKilledAfterTheGrace) {
  auto r = launch({"--nproc-per-node", "2", "--master-port", "0", "--stop-grace", "0.5", "sh", "-c",
                   "if [ $RANK = 1 ]; then exit 5; fi; trap '' TERM; sleep 60"},
                  with_timeout(40));
  ASSERT_FALSE(r.timed_out) << r.describe();
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(contains(r.err, "exited with code 5")) << r.err;
}

// A static job and an elastic one (a round of one node): the workers get the signal, the
// launcher exits 1 (torchrun's code when a signal stops it) naming the signal.
TEST(TdistRun, ForwardsSigtermToWorkers) {
  const std::vector<std::vector<std::string>> modes = {
      {"--master-port", "0"},
      {"--nnodes", "1:1", "--rdzv-endpoint", "127.0.0.1:" + std::to_string(test::free_port()),
       "--rdzv-last-call", "0"}};
  for (const auto& mode : modes) {
    std::string dir = test::temp_dir();
    std::thread killer;
    CommandOptions opts;
    opts.timeout = std::chrono::seconds(40);
    opts.on_start = [&](pid_t pid) {
      killer = std::thread([dir, pid] {
        // Wait until both workers are up (they create their ready files), then signal.
        for (int i = 0; i < 2000; ++i) {
          if (access((dir + "/ready_0").c_str(), F_OK) == 0 &&
              access((dir + "/ready_1").c_str(), F_OK) == 0)
            break;
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        ::kill(pid, SIGTERM);
      });
    };
    std::vector<std::string> args = {"--nproc-per-node", "2"};
    args.insert(args.end(), mode.begin(), mode.end());
    args.insert(args.end(), {"sh", "-c",
                             "trap 'touch " + dir + "/got_term_$RANK; exit 0' TERM; touch " + dir +
                                 "/ready_$RANK; while true; do sleep 0.05; done"});
    auto r = launch(args, opts);
    killer.join();
    ASSERT_FALSE(r.timed_out) << mode[0] << ": " << r.describe();
    EXPECT_EQ(r.exit_code, 1) << mode[0] << ": " << r.describe();
    EXPECT_TRUE(contains(r.err, "stopped by SIGTERM")) << mode[0] << ": " << r.err;
    EXPECT_EQ(access((dir + "/got_term_0").c_str(), F_OK), 0) << mode[0] << ": " << r.describe();
    EXPECT_EQ(access((dir + "/got_term_1").c_str(), F_OK), 0) << mode[0] << ": " << r.describe();
  }
}

TEST(TdistRun, RestartsTheGroupWhileRestartsRemain) {
  // Fails on the first attempt, succeeds on the second.
  auto r = launch({"--nproc-per-node", "2", "--master-port", "0", "--max-restarts", "2", "sh", "-c",
                   "echo attempt $TDIST_RESTART_COUNT of $TDIST_MAX_RESTARTS; "
                   "[ $TDIST_RESTART_COUNT -ge 1 ] || exit 4"});
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_TRUE(contains(r.out, "[rank 0] attempt 1 of 2")) << r.out;
  EXPECT_TRUE(contains(r.err, "restarting all workers (restart 1 of 2)")) << r.err;
  EXPECT_FALSE(contains(r.out, "attempt 2 of 2")) << r.out;
}

TEST(TdistRun, ExhaustedRestartsAreReported) {
  auto r = launch({"--nproc-per-node", "2", "--master-port", "0", "--max-restarts", "2", "sh", "-c",
                   "echo attempt $TDIST_RESTART_COUNT; exit 7"});
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_TRUE(contains(r.out, "attempt 2")) << r.out;
  EXPECT_TRUE(contains(r.err, "exited with code 7 (after 2 of 2 restarts)")) << r.err;
}

TEST(TdistRun, LogDirHoldsOneFilePerRankAndStream) {
  std::string dir = test::temp_dir();
  auto r = launch({"--nproc-per-node", "2", "--master-port", "0", "--log-dir", dir, "--no-tee",
                   "sh", "-c", "echo out $RANK; echo err $RANK >&2"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_FALSE(contains(r.out, "out 0")) << "--no-tee keeps worker output off the console";
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream out(dir + "/attempt_0/rank_" + std::to_string(rank) + ".stdout");
    std::ifstream err(dir + "/attempt_0/rank_" + std::to_string(rank) + ".stderr");
    std::string o, e;
    std::getline(out, o);
    std::getline(err, e);
    EXPECT_EQ(o, "out " + std::to_string(rank));
    EXPECT_EQ(e, "err " + std::to_string(rank));
  }
}

// Secure by default (issue 41, item 5): a multi-node job whose store is beyond loopback and
// that has no token refuses to start, naming the ways out; --insecure runs it anyway (its
// workers get TDIST_ALLOW_NO_TOKEN=1, so their own ports start too) after the warning.
TEST(TdistRun, AMultiNodeJobBeyondLoopbackWithoutATokenRunsOnlyWhenInsecure) {
  CommandOptions o;
  o.env = {{"TDIST_TOKEN", ""}, {"TDIST_TOKEN_FILE", ""}, {"TDIST_ALLOW_NO_TOKEN", ""}};
  const std::vector<std::string> node1 = {"--nnodes",      "2",           "--node-rank",   "1",
                                          "--master-addr", "192.0.2.200", "--master-port", "29998"};
  auto refused = launch(with_command(node1, {"sh", "-c", "echo started"}), o);
  EXPECT_EQ(refused.exit_code, 2) << refused.describe();
  EXPECT_FALSE(contains(refused.out, "started")) << refused.out;
  EXPECT_TRUE(contains(refused.err, "has no token")) << refused.err;
  EXPECT_TRUE(contains(refused.err, "--token-file")) << refused.err;
  EXPECT_TRUE(contains(refused.err, "--insecure")) << refused.err;
  std::vector<std::string> insecure = node1;
  insecure.push_back("--insecure");
  auto ran = launch(with_command(insecure, {"sh", "-c", "echo allow=$TDIST_ALLOW_NO_TOKEN"}), o);
  ASSERT_EQ(ran.exit_code, 0) << ran.describe();
  EXPECT_TRUE(contains(ran.out, "allow=1")) << ran.out;
  EXPECT_TRUE(contains(ran.err, "warning: this multi-node job has no token")) << ran.err;
}

// A link planted at a worker's log file (another user of a shared log directory) is not
// followed: the launcher refuses to start the worker, names the file, and the link's target
// keeps its contents. The logs it makes are group-readable at most (0640).
TEST(TdistRun, ALinkPlantedAtAWorkerLogIsNotFollowed) {
  const std::string dir = test::temp_dir();
  {
    auto r = launch({"--nproc-per-node", "1", "--master-port", "0", "--log-dir", dir, "--no-tee",
                     "sh", "-c", "echo out"});
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    struct stat st {};
    ASSERT_EQ(::stat((dir + "/attempt_0/rank_0.stdout").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0640u);
  }
  const std::string planted = test::temp_dir();
  const std::string victim = planted + "/victim";
  { std::ofstream(victim) << "keep\n"; }
  ::unlink((dir + "/attempt_0/rank_0.stdout").c_str());
  ASSERT_EQ(::symlink(victim.c_str(), (dir + "/attempt_0/rank_0.stdout").c_str()), 0);
  auto r = launch({"--nproc-per-node", "1", "--master-port", "0", "--log-dir", dir, "--no-tee",
                   "sh", "-c", "echo overwritten"});
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_TRUE(contains(r.err, "rank_0.stdout")) << r.err;
  std::ifstream in(victim);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "keep") << "the launcher wrote through a planted link";
}

// A worker that writes 8 MiB without a newline costs the launcher one line's worth of memory:
// the bytes come out as lines of at most 64 KiB (Launcher::kMaxLineBytes), none lost, in order.
TEST(TdistRun, AnEndlessLineIsPassedOnInBoundedPieces) {
  std::string dir = test::temp_dir();
  auto r = launch({"--nproc-per-node", "1", "--master-port", "0", "--log-dir", dir, "--no-tee",
                   "sh", "-c", "head -c 8388608 /dev/zero | tr '\\0' x; echo; echo done"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  std::ifstream out(dir + "/attempt_0/rank_0.stdout");
  size_t lines = 0, bytes = 0, longest = 0;
  std::string line, last;
  while (std::getline(out, line)) {
    ++lines;
    bytes += line.size();
    longest = std::max(longest, line.size());
    EXPECT_EQ(line.find_first_not_of('x'), line == "done" ? 0 : std::string::npos);
    last = line;
  }
  EXPECT_EQ(bytes, 8388608u + 4u) << "every byte is passed on";
  EXPECT_EQ(longest, 65536u) << "lines are cut at 64 KiB";
  EXPECT_EQ(lines, 8388608u / 65536u + 1u);
  EXPECT_EQ(last, "done");
}

// torchrun's flags: --redirects 3 keeps both streams off the console, --tee 2 brings stderr back.
TEST(TdistRun, TeeChoosesWhichStreamsAlsoReachTheConsole) {
  std::string dir = test::temp_dir();
  auto r = launch({"--nproc-per-node", "2", "--master-port", "0", "--log-dir", dir, "--redirects",
                   "3", "--tee", "2", "sh", "-c", "echo out $RANK; echo err $RANK >&2"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_FALSE(contains(r.out, "out 0")) << "-r 3 -t 2 relays stderr only: " << r.out;
  EXPECT_TRUE(contains(r.err, "[rank 0] err 0")) << r.err;
  EXPECT_TRUE(contains(r.err, "[rank 1] err 1")) << r.err;
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream out(dir + "/attempt_0/rank_" + std::to_string(rank) + ".stdout");
    std::string o;
    std::getline(out, o);
    EXPECT_EQ(o, "out " + std::to_string(rank)) << "the log file holds what was not relayed";
  }
}

TEST(TdistRun, BadFlagsExitWithTwoAndAClearMessage) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  std::vector<Case> cases = {
      {{"--nproc-per-node", "0", "true"}, "--nproc-per-node"},
      {{"--nproc-per-node", "99999", "true"}, "--nproc-per-node"},
      {{"--master-port", "70000", "true"}, "--master-port"},
      {{"--nnodes", "2", "--node-rank", "2", "true"}, "--node-rank"},
      {{"--rdzv-endpoint", ":1234", "true"}, "HOST:PORT"},
      {{"--rdzv-endpoint", "host:abc", "true"}, "port 'abc'"},
      {{"--no-such-flag", "true"}, "--no-such-flag"},
      {{"--nproc-per-node", "2"}, "no program"},
      {{"--log-dir", "/tmp", "--tee", "4", "true"}, "--tee"},
      {{"--log-dir", "/tmp", "--no-tee", "--tee", "1", "true"}, "--no-tee: is -r 3"},
      {{"--cpu-bind", "socket", "true"}, "--cpu-bind"},
      {{"--nnodes", "1:4", "true"}, "needs --rdzv-endpoint HOST:PORT"},
      {{"--nnodes", "3:2", "--rdzv-endpoint", "127.0.0.1:1234", "true"}, "MIN:MAX"},
      {{"--nnodes", "x", "true"}, "--nnodes"},
      {{"--rdzv-backend", "etcd", "true"}, "--rdzv-backend"},
      {{"--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1234", "--rdzv-conf", "join_timeout",
        "true"},
       "KEY=VALUE"},
      {{"--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1234", "--rdzv-conf", "join_timeout=soon",
        "true"},
       "positive number"},
  };
  for (const auto& c : cases) {
    auto r = launch(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args[0] << ": " << r.describe();
    EXPECT_TRUE(contains(r.err, c.message)) << "'" << c.message << "' not in: " << r.err;
  }
}

// Note [Binding workers to cores]: each local rank runs on its own CPU of the launcher's mask,
// and more workers than those CPUs is refused before any starts.
TEST(TdistRun, CpuBindCoreGivesEachLocalRankACpuOfItsOwn) {
  const std::vector<int> cpus = env::allowed_cpus();
  if (cpus.size() < 2) GTEST_SKIP() << "needs two CPUs, this process may use " << cpus.size();
  auto r = launch({"--nproc-per-node", "2", "--master-port", "0", "--cpu-bind", "core", "sh", "-c",
                   "grep Cpus_allowed_list /proc/self/status"},
                  with_timeout(60));
  ASSERT_TRUE(r.exited && r.exit_code == 0) << r.describe();
  std::regex line(R"(\[rank (\d)\] Cpus_allowed_list:\s*(\S+))");
  std::map<int, std::string> seen;
  std::istringstream in(r.out);
  for (std::string l; std::getline(in, l);) {
    std::smatch m;
    if (std::regex_match(l, m, line)) seen[std::stoi(m[1])] = m[2];
  }
  EXPECT_EQ(seen, (std::map<int, std::string>{{0, std::to_string(cpus[0])},
                                              {1, std::to_string(cpus[1])}}))
      << r.describe();

  const std::string too_many = std::to_string(cpus.size() + 1);
  auto refused = launch({"--nproc-per-node", too_many, "--master-port", "0", "--cpu-bind", "core",
                         "sh", "-c", "echo started"},
                        with_timeout(60));
  EXPECT_EQ(refused.exit_code, 2) << refused.describe();
  EXPECT_TRUE(contains(refused.err, "--cpu-bind core: " + too_many + " workers per node"))
      << refused.err;
  EXPECT_FALSE(contains(refused.out, "started")) << "no worker starts: " << refused.out;
}

TEST(TdistRun, AMissingProgramIsAWorkerFailure) {
  auto r = launch({"--nproc-per-node", "1", "--master-port", "0", "/no/such/program"});
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_TRUE(contains(r.err, "cannot execute '/no/such/program'")) << r.err;
  EXPECT_TRUE(contains(r.err, "exited with code 127")) << r.err;
}

}  // namespace
}  // namespace tdist
