// tdist-train as a user runs it: real processes, alone or under tdist-run, on synthetic data or
// on small IDX files the tests write.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "tests/apps/programs.h"
#include "tests/harness/command.h"
#include "tests/harness/expect.h"
#include "tests/harness/process.h"

namespace tdist {
namespace {

using test::CommandOptions;
using test::CommandResult;
using test::run_command;

using test::contains;
using test::kRun;
using test::kTrain;
using test::with_timeout;

// tdist-train alone (one process, one intra-op thread).
CommandResult train(std::vector<std::string> args, CommandOptions opts = with_timeout(60)) {
  args.insert(args.begin(), {kTrain, "--threads", "1"});
  return run_command(args, opts);
}

// `nproc` workers of tdist-train under tdist-run; `launcher_args` go to tdist-run.
CommandResult train_under_run(int nproc, std::vector<std::string> launcher_args,
                              std::vector<std::string> args,
                              CommandOptions opts = with_timeout(90)) {
  std::vector<std::string> argv = {kRun, "--nproc-per-node", std::to_string(nproc), "--master-port",
                                   "0"};
  argv.insert(argv.end(), launcher_args.begin(), launcher_args.end());
  argv.push_back(kTrain);
  argv.insert(argv.end(), args.begin(), args.end());
  return run_command(argv, opts);
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  if (!in) return {};
  return nlohmann::json::parse(in);
}

std::vector<nlohmann::json> read_json_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// The parameter hashes every rank printed at the end ("rank R of W: trained ...").
std::map<int, std::string> final_hashes(const std::string& out) {
  std::map<int, std::string> hashes;
  std::regex re(R"(rank (\d+) of \d+: trained \d+ steps, .*parameters fnv1a64 ([0-9a-f]{16}))");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it) {
    hashes[std::stoi((*it)[1])] = (*it)[2];
  }
  return hashes;
}

TEST(TdistTrain, SyntheticTrainingOnTwoRanksReachesEightyPercent) {
  const std::string dir = test::temp_dir();
  auto r = train_under_run(2, {}, {"--dataset",      "synthetic",
                                   "--model",        "mlp",
                                   "--hidden",       "128",
                                   "--layers",       "1",
                                   "--steps",        "200",
                                   "--log-every",    "20",
                                   "--seed",         "1",
                                   "--test-samples", "4000",
                                   "--summary",      dir + "/summary.json",
                                   "--metrics",      dir + "/metrics.jsonl"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto s = read_json(dir + "/summary.json");
  EXPECT_EQ(s["world_size"], 2);
  EXPECT_EQ(s["steps"], 200);
  EXPECT_EQ(s["params"], 784 * 128 + 128 + 128 * 10 + 10);
  EXPECT_EQ(s["eval_samples"], 4000);
  EXPECT_GE(s["accuracy"].get<double>(), 0.80) << s.dump(2);
  EXPECT_GT(s["samples_per_sec"].get<double>(), 0.0);
  // DDP kept the replicas identical.
  auto hashes = final_hashes(r.out);
  ASSERT_EQ(hashes.size(), 2u) << r.out;
  EXPECT_EQ(hashes[0], hashes[1]);
  EXPECT_EQ(hashes[0], s["params_fnv1a64"]);

  // One metrics line per report (every 20 steps) plus the final evaluation; the loss fell.
  auto lines = read_json_lines(dir + "/metrics.jsonl");
  std::vector<nlohmann::json> train_lines;
  for (const auto& l : lines) {
    if (l["event"] == "train") train_lines.push_back(l);
  }
  ASSERT_EQ(train_lines.size(), 10u) << r.out;
  for (const char* key : {"step", "loss", "samples_per_sec", "backward_ms", "comm_wait_ms"}) {
    EXPECT_TRUE(train_lines.front().contains(key)) << key << " missing: " << train_lines.front();
  }
  EXPECT_EQ(train_lines.back()["step"], 200);
  EXPECT_LT(train_lines.back()["loss"].get<double>(),
            0.5 * train_lines.front()["loss"].get<double>());
  EXPECT_EQ(lines.back()["event"], "eval");
  EXPECT_EQ(lines.back()["accuracy"], s["accuracy"]);
  // Log lines go to stdout on rank 0 only.
  EXPECT_TRUE(contains(r.out, "[rank 0] step 200/200")) << r.out;
  EXPECT_FALSE(contains(r.out, "[rank 1] step")) << r.out;
}

TEST(TdistTrain, ConvNetWithAdamTrainsAloneWithoutALauncher) {
  const std::string dir = test::temp_dir();
  auto r = train({"--model", "conv", "--hidden", "32", "--optimizer", "adam", "--steps", "40",
                  "--batch-size", "32", "--log-every", "20", "--test-samples", "500", "--metrics",
                  dir + "/m.jsonl", "--summary", dir + "/s.json"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto s = read_json(dir + "/s.json");
  EXPECT_EQ(s["world_size"], 1);
  EXPECT_EQ(s["optimizer"], "adam");
  const int conv = (1 * 9 * 16 + 16) + (16 * 9 * 32 + 32) + (32 * 7 * 7 * 32 + 32) + (32 * 10 + 10);
  EXPECT_EQ(s["params"], conv);
  auto lines = read_json_lines(dir + "/m.jsonl");
  ASSERT_GE(lines.size(), 2u);
  EXPECT_LT(lines[1]["loss"].get<double>(), lines[0]["loss"].get<double>()) << r.out;
}

TEST(TdistTrain, DdpOptionsReachTheModel) {
  auto run = [](std::vector<std::string> extra) {
    std::vector<std::string> args = {"--steps",        "15",  "--hidden",   "48",  "--layers", "2",
                                     "--test-samples", "200", "--progress", "none"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto r = train_under_run(2, {}, args);
    EXPECT_EQ(r.exit_code, 0) << r.describe();
    auto hashes = final_hashes(r.out);
    EXPECT_EQ(hashes.size(), 2u) << r.out;
    EXPECT_EQ(hashes[0], hashes[1]) << "replicas differ with " << testing::PrintToString(extra);
    return hashes[0];
  };
  const std::string plain = run({});
  // Two ranks: (a + b) / 2 is exact whatever the buckets, so these must not change the result.
  EXPECT_EQ(run({"--bucket-cap-mb", "0.05", "--first-bucket-cap-mb", "0.01",
                 "--gradient-as-bucket-view", "--static-graph"}),
            plain);
  // fp16 compression rounds the gradients: the hook is in use.
  EXPECT_NE(run({"--comm-hook", "fp16"}), plain);
}

TEST(TdistTrain, MlpShapeFollowsHiddenAndLayers) {
  auto r = train({"--hidden", "1024", "--layers", "3", "--steps", "1", "--test-samples", "10",
                  "--progress", "none"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_TRUE(contains(r.out, "mlp 784-1024-1024-1024-10 (2913290 parameters)")) << r.out;
}

TEST(TdistTrain, ProgressBarOrLogLines) {
  auto bar = train({"--steps", "20", "--log-every", "5", "--hidden", "16", "--layers", "1",
                    "--test-samples", "100", "--progress", "bar"});
  ASSERT_EQ(bar.exit_code, 0) << bar.describe();
  EXPECT_TRUE(contains(bar.out, "\rstep 20/20 [")) << bar.out;
  EXPECT_TRUE(contains(bar.out, "ETA")) << bar.out;
  EXPECT_TRUE(contains(bar.out, "samples/s")) << bar.out;
  // Not a terminal and no --progress: plain lines.
  auto log = train({"--steps", "20", "--log-every", "5", "--hidden", "16", "--layers", "1",
                    "--test-samples", "100"});
  ASSERT_EQ(log.exit_code, 0) << log.describe();
  EXPECT_FALSE(contains(log.out, "\r")) << log.out;
  EXPECT_TRUE(contains(log.out, "\nstep 5/20 epoch 0: loss ")) << log.out;
}

// --- fault and resume -----------------------------------------------------------------------

std::vector<std::string> resume_args(const std::string& dir) {
  return {"--hidden",
          "64",
          "--layers",
          "1",
          "--optimizer",
          "adam",
          "--steps",
          "40",
          "--batch-size",
          "32",
          "--log-every",
          "10",
          "--test-samples",
          "1000",
          "--checkpoint-dir",
          dir + "/ckpt",
          "--checkpoint-every",
          "10",
          "--resume",
          "--summary",
          dir + "/summary.json",
          "--seed",
          "7"};
}

TEST(TdistTrain, AKilledWorkerRestartsFromTheCheckpointAndEndsLikeAnUninterruptedRun) {
  const std::string clean = test::temp_dir();
  auto a = train_under_run(2, {}, resume_args(clean));
  ASSERT_EQ(a.exit_code, 0) << a.describe();
  EXPECT_TRUE(contains(a.out, "no checkpoint in")) << a.out;

  // Rank 1 kills itself (SIGKILL) when 25 steps are done, on the first attempt only.
  const std::string faulty = test::temp_dir();
  // What a write killed half-way leaves behind; the next checkpoint removes it.
  ::mkdir((faulty + "/ckpt").c_str(), 0755);
  std::ofstream(faulty + "/ckpt/checkpoint.pt.tmp.99999") << "torn";
  auto b = train_under_run(2, {"--max-restarts", "1", "--stop-grace", "2"}, resume_args(faulty),
                           with_timeout(90, {{"TDIST_TRAIN_FAIL_AT_STEP", "25"}}));
  ASSERT_EQ(b.exit_code, 0) << b.describe();
  EXPECT_TRUE(
      contains(b.err, "[rank 1] tdist-train: TDIST_TRAIN_FAIL_AT_STEP=25: killing this worker"))
      << b.err;
  // (The launcher names whichever failure it saw first: rank 1's SIGKILL, or rank 0's error.)
  EXPECT_TRUE(contains(b.err, "restarting all workers (restart 1 of 1)")) << b.err;
  EXPECT_TRUE(contains(b.out, "resumed from " + faulty + "/ckpt/checkpoint.pt at step 20"))
      << b.out;

  auto sa = read_json(clean + "/summary.json");
  auto sb = read_json(faulty + "/summary.json");
  EXPECT_EQ(sb["resumed_from_step"], 20);
  EXPECT_EQ(sb["steps_run"], 20);
  EXPECT_EQ(sa["steps"], 40);
  EXPECT_EQ(sb["steps"], 40);
  // Bit-equal parameters: the resumed run continued exactly where the killed one left off.
  EXPECT_EQ(sa["params_fnv1a64"], sb["params_fnv1a64"]);
  EXPECT_EQ(sa["accuracy"], sb["accuracy"]);
  EXPECT_EQ(sa["final_loss"], sb["final_loss"]);
  EXPECT_EQ(final_hashes(a.out)[1], final_hashes(b.out)[1]);

  // Only the final checkpoint is left: no temporary files, the stale one removed.
  std::string listing = run_command({"ls", "-a", faulty + "/ckpt"}).out;
  EXPECT_EQ(listing, ".\n..\ncheckpoint.pt\n");

  // Resuming a finished run trains no further and reports the same state.
  auto c = train_under_run(2, {}, resume_args(faulty));
  ASSERT_EQ(c.exit_code, 0) << c.describe();
  auto sc = read_json(faulty + "/summary.json");
  EXPECT_EQ(sc["steps_run"], 0);
  EXPECT_EQ(sc["params_fnv1a64"], sa["params_fnv1a64"]);
}

// One process state letter from /proc/<pid>/stat ('T' stopped, 'Z' zombie), or 0 when it is gone.
char process_state(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? 0 : stat[paren + 2];
}

off_t file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_size : -1;
}

// Kills the writer of a checkpoint inside its write (Note [Checkpoint protocol] 2): watches the
// checkpoint directory (inotify) for the writer's temporary file, checkpoint.pt.tmp.<pid>, and
// when one appears while a complete checkpoint.pt exists, kills that pid (SIGKILL) as soon as the
// file has its first bytes (mid-write, usually). Once the writer is dead, a temporary file still
// there shows that the kill came before the rename (during the write or the fsync); if the file
// is gone, the writer was
// quicker (renamed already) and the next write, after the launcher's restart, is tried. No hook
// in tdist-train: the window is the real write, fsync and rename of a checkpoint of some
// megabytes.
struct Strike {
  bool struck = false;        // the writer was killed inside its write
  int missed = 0;             // writers killed after their rename
  off_t tmp_bytes = -1;       // the temporary file's size once the writer was dead
  off_t complete_bytes = -1;  // the complete checkpoint's size beside it
};

class CheckpointWriteStriker {
 public:
  // Fills `out`, which may be read once the striker is destroyed.
  CheckpointWriteStriker(const std::string& dir, Strike& out) : dir_(dir), out_(out) {
    fd_ = ::inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
    EXPECT_GE(fd_, 0);
    EXPECT_GE(::inotify_add_watch(fd_, dir.c_str(), IN_CREATE), 0) << dir;
    thread_ = std::thread([this] { watch(); });
  }
  ~CheckpointWriteStriker() {
    done_ = true;
    thread_.join();
    ::close(fd_);
  }

 private:
  void watch() {
    const std::string prefix = std::string("checkpoint.pt.tmp.");
    alignas(inotify_event) char buf[4096];
    while (!done_ && !out_.struck) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const ssize_t n = ::read(fd_, buf, sizeof(buf));
      for (ssize_t at = 0; at < n && !out_.struck;) {
        const auto* e = reinterpret_cast<const inotify_event*>(buf + at);
        at += static_cast<ssize_t>(sizeof(inotify_event) + e->len);
        const std::string name = e->len > 0 ? e->name : "";
        if (name.rfind(prefix, 0) != 0) continue;
        const std::string tmp = dir_ + "/" + name, complete = dir_ + "/checkpoint.pt";
        if (file_size(complete) < 0) continue;  // the first write: nothing to fall back on
        if (out_.missed == 2) continue;         // tdist-run --max-restarts 2 allows no further kill
        const pid_t pid = static_cast<pid_t>(std::stol(name.substr(prefix.size())));
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
        while (file_size(tmp) == 0 && std::chrono::steady_clock::now() < give_up) {}
        if (::kill(pid, SIGKILL) != 0) continue;
        // Dead (a zombie until the launcher reaps it, or gone): it renames nothing any more.
        for (int i = 0; i < 5000; ++i) {
          const char state = process_state(pid);
          if (state == 'Z' || state == 'X' || state == 0) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        out_.tmp_bytes = file_size(tmp);
        if (out_.tmp_bytes < 0) {
          ++out_.missed;
          continue;
        }
        out_.complete_bytes = file_size(complete);
        out_.struck = true;
      }
    }
  }

  std::string dir_;
  Strike& out_;
  int fd_ = -1;
  std::atomic<bool> done_{false};
  std::thread thread_;
};

// The writer (rank 0) is killed inside a checkpoint write: the complete checkpoint before it is
// what the restart resumes from, the temporary file of the cut-off write is removed by the next
// write, and the run ends as an uninterrupted one does.
TEST(TdistTrain, AWriterKilledInsideACheckpointWriteLeavesTheLastCheckpointAndTheRunEndsTheSame) {
  // A model of 1.9 M parameters: with Adam's two moments, a checkpoint of about 22 MB.
  const auto args = [](const std::string& dir) {
    auto a = resume_args(dir);
    for (size_t i = 0; i + 1 < a.size(); ++i) {
      if (a[i] == "--hidden") a[i + 1] = "1024";
      if (a[i] == "--layers") a[i + 1] = "2";
    }
    return a;
  };
  const std::string clean = test::temp_dir();
  auto a = train_under_run(2, {}, args(clean));
  ASSERT_EQ(a.exit_code, 0) << a.describe();

  const std::string faulty = test::temp_dir();
  ::mkdir((faulty + "/ckpt").c_str(), 0755);
  CommandResult b;
  Strike strike;
  {
    CheckpointWriteStriker striker(faulty + "/ckpt", strike);
    // A second restart in case the first kill came after the rename.
    b = train_under_run(2, {"--max-restarts", "2", "--stop-grace", "2"}, args(faulty));
  }
  std::cout << "killed the writer with " << strike.tmp_bytes << " of " << strike.complete_bytes
            << " bytes in its temporary file (" << strike.missed
            << " kills after the rename first)\n";
  ASSERT_TRUE(strike.struck) << "no kill came before the rename (" << strike.missed << " after)\n"
                             << b.describe();
  ASSERT_EQ(b.exit_code, 0) << b.describe();
  EXPECT_TRUE(
      contains(b.err, "restarting all workers (restart " + std::to_string(strike.missed + 1)))
      << b.err;
  // The restart resumed from the last complete checkpoint: it loaded, its fingerprint matched.
  const std::regex resumed("resumed from " + faulty + "/ckpt/checkpoint.pt at step (\\d+)");
  int resumed_at = -1;
  for (auto it = std::sregex_iterator(b.out.begin(), b.out.end(), resumed);
       it != std::sregex_iterator(); ++it) {
    resumed_at = std::stoi((*it)[1]);  // the last restart's
  }
  EXPECT_TRUE(resumed_at == 10 || resumed_at == 20 || resumed_at == 30) << b.out;

  auto sa = read_json(clean + "/summary.json");
  auto sb = read_json(faulty + "/summary.json");
  EXPECT_EQ(sb["resumed_from_step"], resumed_at);
  EXPECT_EQ(sb["steps"], 40);
  EXPECT_EQ(sa["params_fnv1a64"], sb["params_fnv1a64"]);
  EXPECT_EQ(sa["accuracy"], sb["accuracy"]);
  EXPECT_EQ(sa["final_loss"], sb["final_loss"]);
  // The cut-off write's temporary file is gone: only the final checkpoint is left.
  EXPECT_EQ(run_command({"ls", "-a", faulty + "/ckpt"}).out, ".\n..\ncheckpoint.pt\n");
}

// Note [Elastic resume]: a run killed at world size 3 resumes at world size 2 where its samples
// left off: 960 samples, batch 8 per rank, 2 epochs. Killed after 25 steps of 24 samples (600 of
// epoch 0), it goes on with (960 - 600) / 16 = 22 steps of 16, then 60 in epoch 1: 107 steps
// (counting steps of the new world size from the start of the epoch would give 97 or 120).
// The same history gives the same parameters; another history does not.
TEST(TdistTrain, ResumesAtAnotherWorldSizeWhereItsSamplesLeftOff) {
  const auto args = [](const std::string& dir) {
    return std::vector<std::string>{"--hidden",
                                    "32",
                                    "--layers",
                                    "1",
                                    "--train-samples",
                                    "960",
                                    "--test-samples",
                                    "100",
                                    "--batch-size",
                                    "8",
                                    "--epochs",
                                    "2",
                                    "--threads",
                                    "1",
                                    "--checkpoint-dir",
                                    dir + "/ckpt",
                                    "--checkpoint-every",
                                    "5",
                                    "--resume",
                                    "--summary",
                                    dir + "/summary.json",
                                    "--seed",
                                    "3"};
  };
  // Rank 0 stops itself at step 25, after it wrote that step's checkpoint (had another rank
  // died first, the launcher could stop rank 0 before the write).
  const auto history = [&](const std::string& dir) {
    auto killed = train_under_run(
        3, {"--stop-grace", "2"}, args(dir),
        with_timeout(90, {{"TDIST_TRAIN_FAIL_AT_STEP", "25"}, {"TDIST_TRAIN_FAIL_RANK", "0"}}));
    EXPECT_NE(killed.exit_code, 0) << killed.describe();
    auto resumed = train_under_run(2, {}, args(dir));
    EXPECT_EQ(resumed.exit_code, 0) << resumed.describe();
    EXPECT_TRUE(contains(resumed.out, "resumed from " + dir +
                                          "/ckpt/checkpoint.pt at step 25 "
                                          "(epoch 0, sample 600 of 960)"))
        << resumed.out;
    EXPECT_TRUE(contains(resumed.out,
                         "the checkpoint was written at world size 3; continuing at "
                         "world size 2: a step now takes 16 samples"))
        << resumed.out;
    return read_json(dir + "/summary.json");
  };
  const std::string a = test::temp_dir(), b = test::temp_dir(), c = test::temp_dir();
  auto sa = history(a);
  EXPECT_EQ(sa["resumed_from_step"], 25);
  EXPECT_EQ(sa["steps"], 107);
  EXPECT_EQ(sa["steps_run"], 82);
  EXPECT_EQ(sa["world_size"], 2);
  auto sb = history(b);
  EXPECT_EQ(sb["params_fnv1a64"], sa["params_fnv1a64"]) << "the same history, other parameters";
  auto only_two = train_under_run(2, {}, args(c));
  ASSERT_EQ(only_two.exit_code, 0) << only_two.describe();
  auto sc = read_json(c + "/summary.json");
  EXPECT_EQ(sc["steps"], 120);
  EXPECT_NE(sc["params_fnv1a64"], sa["params_fnv1a64"]) << "the world size history left no trace";
}

TEST(TdistTrain, ResumeRefusesACheckpointOfAnotherRun) {
  const std::string dir = test::temp_dir();
  auto first = train({"--hidden", "32", "--layers", "1", "--steps", "5", "--test-samples", "10",
                      "--checkpoint-dir", dir});
  ASSERT_EQ(first.exit_code, 0) << first.describe();
  auto other = train({"--hidden", "16", "--layers", "1", "--steps", "5", "--test-samples", "10",
                      "--checkpoint-dir", dir, "--resume"});
  EXPECT_EQ(other.exit_code, 2) << other.describe();
  EXPECT_TRUE(contains(other.err, "the checkpoint belongs to a different run")) << other.err;
  EXPECT_TRUE(contains(other.err, "mlp 784-32-10")) << other.err;

  // A damaged checkpoint is an error (exit 1), not a fresh start: one flipped byte of the archive
  // is caught by the digest in the header, before libtorch reads it.
  {
    std::ifstream in(dir + "/checkpoint.pt", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_GT(bytes.size(), 100u);
    bytes[bytes.size() - 50] ^= 1;
    std::ofstream(dir + "/checkpoint.pt", std::ios::trunc | std::ios::binary) << bytes;
  }
  auto flipped = train({"--hidden", "32", "--layers", "1", "--steps", "5", "--test-samples", "10",
                        "--checkpoint-dir", dir, "--resume"});
  EXPECT_EQ(flipped.exit_code, 1) << flipped.describe();
  EXPECT_TRUE(contains(flipped.err, "does not match the digest in its header")) << flipped.err;
  std::ofstream(dir + "/checkpoint.pt", std::ios::trunc) << "not a checkpoint";
  auto damaged = train({"--hidden", "32", "--layers", "1", "--steps", "5", "--test-samples", "10",
                        "--checkpoint-dir", dir, "--resume"});
  EXPECT_EQ(damaged.exit_code, 1) << damaged.describe();
  EXPECT_TRUE(contains(damaged.err, "the checkpoint is not readable")) << damaged.err;

  // The fingerprint is checked before libtorch parses anything: another run's header in front of
  // bytes that are no archive at all is refused as another run's.
  {
    const std::string fingerprint = "another run's settings";
    std::string forged = "TDCKPT05";
    for (int i = 0; i < 8; ++i)
      forged.push_back(static_cast<char>((fingerprint.size() >> (8 * i)) & 0xff));
    forged += fingerprint + "no libtorch archive follows";
    std::ofstream(dir + "/checkpoint.pt", std::ios::trunc | std::ios::binary) << forged;
  }
  auto forged = train({"--hidden", "32", "--layers", "1", "--steps", "5", "--test-samples", "10",
                       "--checkpoint-dir", dir, "--resume"});
  EXPECT_EQ(forged.exit_code, 2) << forged.describe();
  EXPECT_TRUE(contains(forged.err, "checkpoint: another run's settings")) << forged.err;
}

// Note [Checkpoint key] (issue 41, item 11): with the job's token the checkpoint's digest is an
// HMAC keyed with it, so a checkpoint of another token, a changed one, or one written without a
// token is refused (exit 1, naming why), and a run without the token refuses a keyed one; the
// file is 0600 in a directory made 0700, and a directory that group or others can write, a
// symbolic link to one, or one of another user is refused before anything is written there.
TEST(TdistTrain, CheckpointsAreKeyedWithTheJobsTokenAndKeptInAPrivateDirectory) {
  const std::string root = test::temp_dir();
  const std::string dir = root + "/made/here";
  const std::vector<std::string> args = {"--hidden",         "16", "--layers",       "1",
                                         "--steps",          "3",  "--test-samples", "10",
                                         "--checkpoint-dir", dir};
  auto resume = args;
  resume.push_back("--resume");
  auto with_token = [](const std::string& token) {
    return with_timeout(
        60, {{"TDIST_TOKEN", token}, {"TDIST_TOKEN_FILE", ""}, {"TDIST_TOKEN_DRAWN", ""}});
  };
  auto first = train(args, with_token("token-a"));
  ASSERT_EQ(first.exit_code, 0) << first.describe();
  struct stat st {};
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u) << "the directory tdist-train made";
  ASSERT_EQ(::stat((dir + "/checkpoint.pt").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u) << "the checkpoint";

  auto same = train(resume, with_token("token-a"));
  EXPECT_EQ(same.exit_code, 0) << same.describe();
  auto other = train(resume, with_token("token-b"));
  EXPECT_EQ(other.exit_code, 1) << other.describe();
  EXPECT_TRUE(contains(other.err, "does not match the keyed digest")) << other.err;
  auto none = train(resume, with_token(""));
  EXPECT_EQ(none.exit_code, 1) << none.describe();
  EXPECT_TRUE(contains(none.err, "keyed with the job's token")) << none.err;
  // The token tdist-run draws for one run keys nothing: such a run writes a plain digest, which
  // a run with a token then refuses.
  auto drawn = train(
      args, with_timeout(60, {{"TDIST_TOKEN", "drawn-for-one-run"}, {"TDIST_TOKEN_DRAWN", "1"}}));
  ASSERT_EQ(drawn.exit_code, 0) << drawn.describe();
  auto plain = train(resume, with_token("token-a"));
  EXPECT_EQ(plain.exit_code, 1) << plain.describe();
  EXPECT_TRUE(contains(plain.err, "the checkpoint's digest is not keyed")) << plain.err;
  EXPECT_EQ(train(resume, with_token("")).exit_code, 0) << "a plain checkpoint without a token";

  // Directories others could write into, or a link that could be turned elsewhere.
  ASSERT_EQ(::chmod(dir.c_str(), 0770), 0);
  auto writable = train(args, with_token("token-a"));
  EXPECT_NE(writable.exit_code, 0) << writable.describe();
  EXPECT_TRUE(contains(writable.err, "group or others can write it")) << writable.err;
  auto writable_resume = train(resume, with_token("token-a"));
  EXPECT_NE(writable_resume.exit_code, 0) << writable_resume.describe();
  EXPECT_TRUE(contains(writable_resume.err, "group or others can write it")) << writable_resume.err;
  ASSERT_EQ(::chmod(dir.c_str(), 0700), 0);
  const std::string link = root + "/link";
  ASSERT_EQ(::symlink(dir.c_str(), link.c_str()), 0);
  auto via_link = args;
  via_link.back() = link + "/";
  auto linked = train(via_link, with_token("token-a"));
  EXPECT_NE(linked.exit_code, 0) << linked.describe();
  EXPECT_TRUE(contains(linked.err, "is a symbolic link")) << linked.err;
  if (::geteuid() == 0) {
    ASSERT_EQ(::chown(dir.c_str(), 65534, 65534), 0);
    auto foreign = train(args, with_token("token-a"));
    EXPECT_NE(foreign.exit_code, 0) << foreign.describe();
    EXPECT_TRUE(contains(foreign.err, "belongs to uid 65534")) << foreign.err;
  }
}

// --- IDX files ------------------------------------------------------------------------------

void put_u32(std::string& s, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) s.push_back(static_cast<char>((v >> shift) & 0xff));
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Tiny MNIST-format files: label k is drawn as a bright 7x7 square at one of 10 places plus
// seeded noise, so that a model that reads images and labels correctly learns it fast.
void write_idx_split(const std::string& dir, const std::string& prefix, uint32_t n, uint32_t seed) {
  std::string images, labels;
  put_u32(images, 0x00000803);
  put_u32(images, n);
  put_u32(images, 28);
  put_u32(images, 28);
  put_u32(labels, 0x00000801);
  put_u32(labels, n);
  uint32_t state = seed * 2654435761u + 1;
  auto next = [&] {
    state = state * 1664525u + 1013904223u;
    return state >> 24;
  };
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t label = (i * 7 + seed) % 10;
    labels.push_back(static_cast<char>(label));
    const uint32_t top = (label / 5) * 14 + 3, left = (label % 5) * 5 + 1;
    for (uint32_t y = 0; y < 28; ++y) {
      for (uint32_t x = 0; x < 28; ++x) {
        const bool in = y >= top && y < top + 7 && x >= left && x < left + 4;
        images.push_back(static_cast<char>(in ? 200 + next() % 56 : next() % 60));
      }
    }
  }
  write_file(dir + "/" + prefix + "-images-idx3-ubyte", images);
  write_file(dir + "/" + prefix + "-labels-idx1-ubyte", labels);
}

TEST(TdistTrain, ReadsMnistIdxFiles) {
  const std::string dir = test::temp_dir();
  write_idx_split(dir, "train", 256, 1);
  write_idx_split(dir, "t10k", 60, 2);
  const std::string summary = dir + "/summary.json";
  auto r = train({"--data-dir", dir, "--hidden", "32", "--layers", "1", "--steps", "40",
                  "--batch-size", "32", "--summary", summary});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto s = read_json(summary);
  EXPECT_TRUE(contains(s["dataset"].get<std::string>(), "mnist " + dir + " (256 train, 60 test)"))
      << s.dump(2);
  EXPECT_EQ(s["steps_per_epoch"], 256 / 32);
  EXPECT_EQ(s["eval_samples"], 60);
  // Labels that did not match their images would leave the model near chance (10%).
  EXPECT_GE(s["accuracy"].get<double>(), 0.9) << r.out;

  // --train-samples limits what is used.
  auto limited = train({"--data-dir", dir, "--train-samples", "64", "--steps", "2", "--batch-size",
                        "32", "--hidden", "8", "--layers", "1"});
  ASSERT_EQ(limited.exit_code, 0) << limited.describe();
  EXPECT_TRUE(contains(limited.out, "(64 train, 60 test)")) << limited.out;
}

TEST(TdistTrain, BadIdxFilesGiveClearErrors) {
  struct Case {
    std::string name;
    std::function<void(const std::string&)> damage;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"truncated images",
       [](const std::string& d) {
         std::string bytes;
         put_u32(bytes, 0x00000803);
         put_u32(bytes, 100);
         put_u32(bytes, 28);
         put_u32(bytes, 28);
         bytes.append(28 * 28 * 3, '\0');
         write_file(d + "/train-images-idx3-ubyte", bytes);
       },
       "truncated"},
      {"bad magic",
       [](const std::string& d) {
         write_file(d + "/train-labels-idx1-ubyte", "\x12\x34\x08\x01xxxx");
       },
       "not an IDX file"},
      {"count mismatch",
       [](const std::string& d) {
         write_idx_split(d, "train", 10, 3);
         write_idx_split(d, "other", 11, 3);
         std::rename((d + "/other-labels-idx1-ubyte").c_str(),
                     (d + "/train-labels-idx1-ubyte").c_str());
       },
       "holds 10 images but"},
      {"label out of range",
       [](const std::string& d) {
         std::string bytes;
         put_u32(bytes, 0x00000801);
         put_u32(bytes, 20);
         bytes.append(19, '\1');
         bytes.push_back('\x0c');
         write_file(d + "/train-labels-idx1-ubyte", bytes);
       },
       "holds label 12"},
      {"wrong image size",
       [](const std::string& d) {
         std::string bytes;
         put_u32(bytes, 0x00000803);
         put_u32(bytes, 20);
         put_u32(bytes, 14);
         put_u32(bytes, 14);
         bytes.append(20 * 14 * 14, '\0');
         write_file(d + "/train-images-idx3-ubyte", bytes);
       },
       "14x14 images; expected 28x28"},
      {"missing file",
       [](const std::string& d) { std::remove((d + "/t10k-images-idx3-ubyte").c_str()); },
       "t10k-images-idx3-ubyte': No such file or directory"},
  };
  for (const auto& c : cases) {
    const std::string dir = test::temp_dir();
    write_idx_split(dir, "train", 20, 1);
    write_idx_split(dir, "t10k", 10, 2);
    c.damage(dir);
    auto r = train({"--data-dir", dir, "--steps", "1", "--batch-size", "4"});
    EXPECT_EQ(r.exit_code, 2) << c.name << ": " << r.describe();
    EXPECT_TRUE(contains(r.err, c.message)) << c.name << ": '" << c.message << "' not in " << r.err;
  }
}

// gzip -n, as the MNIST and Fashion-MNIST files are distributed (gzip is in every Debian).
void gzip_file(const std::string& path) {
  ASSERT_EQ(std::system(("gzip -n -f '" + path + "'").c_str()), 0) << path;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(TdistTrain, ReadsGzipIdxFilesAsFashionMnist) {
  const std::string dir = test::temp_dir();
  write_idx_split(dir, "train", 128, 1);
  write_idx_split(dir, "t10k", 40, 2);
  for (const char* f : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                        "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"}) {
    gzip_file(dir + "/" + f);
  }
  const std::string summary = dir + "/summary.json";
  auto r = train({"--dataset", "fashion-mnist", "--data-dir", dir, "--hidden", "32", "--layers",
                  "1", "--steps", "24", "--batch-size", "32", "--summary", summary});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto s = read_json(summary);
  EXPECT_TRUE(
      contains(s["dataset"].get<std::string>(), "fashion-mnist " + dir + " (128 train, 40 test)"))
      << s.dump(2);
  EXPECT_GE(s["accuracy"].get<double>(), 0.9) << r.out;
}

TEST(TdistTrain, BadGzipIdxFilesGiveClearErrors) {
  struct Case {
    std::string name;
    std::function<void(const std::string&)> damage;  // on train-images-idx3-ubyte.gz
    std::string message;
  };
  const std::vector<Case> cases = {
      {"truncated gzip",
       [](const std::string& path) {
         std::string bytes = read_file(path);
         write_file(path, bytes.substr(0, bytes.size() / 2));
       },
       "train-images-idx3-ubyte.gz': its header declares"},
      {"header larger than the stream",
       [](const std::string& path) {
         std::string bytes;
         put_u32(bytes, 0x00000803);
         put_u32(bytes, 1000000);  // a million images declared, three present
         put_u32(bytes, 28);
         put_u32(bytes, 28);
         bytes.append(28 * 28 * 3, '\0');
         const std::string plain = path.substr(0, path.size() - 3);
         write_file(plain, bytes);
         gzip_file(plain);
       },
       "the gzip stream holds"},
      {"corrupt deflate data",
       [](const std::string& path) {
         std::string bytes = read_file(path);
         // Past the first deflate block's start, so the IDX header still decodes.
         for (size_t i = bytes.size() / 2; i < bytes.size() / 2 + 40; ++i) {
           bytes[i] = static_cast<char>(0xff);
         }
         write_file(path, bytes);
       },
       "corrupt gzip data"},
      {"not gzip at all", [](const std::string& path) { write_file(path, std::string(64, 'x')); },
       "train-images-idx3-ubyte.gz'"},
  };
  for (const auto& c : cases) {
    const std::string dir = test::temp_dir();
    write_idx_split(dir, "train", 20, 1);
    write_idx_split(dir, "t10k", 10, 2);
    gzip_file(dir + "/train-images-idx3-ubyte");
    c.damage(dir + "/train-images-idx3-ubyte.gz");
    auto r = train({"--data-dir", dir, "--steps", "1", "--batch-size", "4"});
    EXPECT_EQ(r.exit_code, 2) << c.name << ": " << r.describe();
    EXPECT_TRUE(contains(r.err, c.message)) << c.name << ": '" << c.message << "' not in " << r.err;
  }
}

// The real Fashion-MNIST that scripts/setup.sh installs (Debian's dataset-fashion-mnist).
TEST(TdistTrain, TrainsOnDebiansFashionMnist) {
  struct stat st {};
  if (::stat("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz", &st) != 0) {
    GTEST_SKIP()
        << "Debian's dataset-fashion-mnist is not installed (scripts/setup.sh installs it)";
  }
  const std::string summary = test::temp_dir() + "/summary.json";
  auto r = train({"--dataset", "fashion-mnist", "--model", "conv", "--optimizer", "adam", "--lr",
                  "0.002", "--steps", "60", "--batch-size", "32", "--test-samples", "1000",
                  "--summary", summary});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto s = read_json(summary);
  EXPECT_TRUE(contains(s["dataset"].get<std::string>(),
                       "fashion-mnist /usr/share/datasets/fashion-mnist (60000 train, 1000 test)"))
      << s.dump(2);
  // 60 steps of 32 images already get well past chance (10%) on real clothes.
  EXPECT_GE(s["accuracy"].get<double>(), 0.5) << r.out;
}

TEST(TdistTrain, AMissingDataDirectoryIsAClearErrorOnEveryRank) {
  auto alone = train({"--data-dir", "/no/such/mnist", "--steps", "1"});
  EXPECT_EQ(alone.exit_code, 2) << alone.describe();
  EXPECT_TRUE(contains(alone.err, "--data-dir '/no/such/mnist': No such file or directory"))
      << alone.err;
  // Under tdist-run the failure is reported with the rank and the worker's message.
  auto launched = train_under_run(2, {}, {"--data-dir", "/no/such/mnist", "--steps", "1"});
  EXPECT_EQ(launched.exit_code, 1) << launched.describe();
  EXPECT_TRUE(contains(launched.err, "exited with code 2")) << launched.err;
  EXPECT_TRUE(contains(launched.err, "/no/such/mnist")) << launched.err;
}

// --device: with every GPU hidden (CUDA_VISIBLE_DEVICES empty, so this holds on any machine),
// cuda fails at start naming the flag and auto trains on the CPU, ending where --device cpu ends.
// Where a GPU is visible, auto trains on it.
TEST(TdistTrain, DeviceCudaNeedsAVisibleGpuAndAutoFallsBackToTheCpu) {
  const std::string dir = test::temp_dir();
  const std::vector<std::string> args = {"--steps",    "12",  "--hidden",       "32",
                                         "--layers",   "1",   "--test-samples", "200",
                                         "--progress", "none"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = args;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const auto no_gpu = with_timeout(60, {{"CUDA_VISIBLE_DEVICES", ""}});

  auto cuda = train(with({"--device", "cuda"}), no_gpu);
  EXPECT_EQ(cuda.exit_code, 2) << cuda.describe();
  EXPECT_TRUE(contains(cuda.err, "--device cuda: ")) << cuda.err;
  EXPECT_TRUE(contains(cuda.err, "no GPU is visible") || contains(cuda.err, "has no CUDA"))
      << cuda.err;
  EXPECT_FALSE(contains(cuda.out, "trained")) << "it trained: " << cuda.out;

  auto cpu = train(with({"--device", "cpu", "--summary", dir + "/cpu.json"}));
  ASSERT_EQ(cpu.exit_code, 0) << cpu.describe();
  auto autod = train(with({"--device", "auto", "--summary", dir + "/auto.json"}), no_gpu);
  ASSERT_EQ(autod.exit_code, 0) << autod.describe();
  EXPECT_EQ(read_json(dir + "/cpu.json")["device"], "cpu");
  EXPECT_EQ(read_json(dir + "/auto.json")["device"], "cpu");
  auto cpu_hash = final_hashes(cpu.out);
  ASSERT_EQ(cpu_hash.size(), 1u) << cpu.out;
  EXPECT_EQ(final_hashes(autod.out), cpu_hash) << autod.out;
  EXPECT_EQ(read_json(dir + "/auto.json")["final_loss"],
            read_json(dir + "/cpu.json")["final_loss"]);

  // Nothing hidden: auto takes a GPU where one is visible (then the run trains on it).
  auto seen = train(with({"--device", "auto", "--summary", dir + "/seen.json"}));
  ASSERT_EQ(seen.exit_code, 0) << seen.describe();
  const std::string device = read_json(dir + "/seen.json")["device"];
  if (device == "cpu") {
    auto again = train(with({"--device", "cuda"}));
    EXPECT_EQ(again.exit_code, 2) << again.describe();
  } else {
    EXPECT_EQ(device, "cuda:0");
    EXPECT_EQ(final_hashes(seen.out).size(), 1u) << seen.out;
  }
}

TEST(TdistTrain, BadFlagsExitWithTwoAndAClearMessage) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--model", "resnet"}, "--model"},
      {{"--optimizer", "rmsprop"}, "--optimizer"},
      {{"--epochs", "1", "--steps", "5"}, "--steps"},
      {{"--batch-size", "0"}, "--batch-size"},
      {{"--batch-size", "many"}, "--batch-size"},
      {{"--lr", "-1"}, "--lr"},
      {{"--model", "conv", "--layers", "2"}, "--layers: applies to --model mlp or gpt"},
      {{"--model", "gpt", "--layers", "0"}, "a gpt has 1 to 256 blocks"},
      {{"--model", "gpt", "--width", "30", "--heads", "4"}, "a multiple of --heads 4"},
      {{"--model", "gpt", "--hidden", "64"}, "--hidden: applies to --model mlp or conv"},
      {{"--model", "mlp", "--context", "64"}, "--context: applies to --model gpt only"},
      {{"--dataset", "text"}, "--dataset text needs --model gpt"},
      {{"--model", "gpt", "--dataset", "synthetic"}, "--model gpt trains on --dataset text"},
      {{"--model", "gpt", "--data-dir", "/no/such/text"}, "--data-dir '/no/such/text'"},
      {{"--strategy", "hsdp"}, "--strategy hsdp needs --shard-size"},
      {{"--strategy", "zero2"}, "--strategy"},
      {{"--shard-size", "2"}, "--shard-size applies to --strategy hsdp only"},
      {{"--strategy", "hsdp", "--shard-size", "-1"}, "--shard-size must be >= 1"},
      {{"--mixed-precision", "bf16"}, "--mixed-precision applies to --strategy fsdp or hsdp"},
      {{"--strategy", "fsdp", "--mixed-precision", "fp8"}, "--mixed-precision"},
      {{"--reshard-after-forward", "false"},
       "--reshard-after-forward: applies to --strategy fsdp or hsdp only"},
      {{"--strategy", "fsdp", "--reshard-after-forward", "maybe"}, "--reshard-after-forward"},
      {{"--strategy", "fsdp", "--bucket-cap-mb", "1"}, "--bucket-cap-mb: is DDP's"},
      {{"--strategy", "fsdp", "--comm-hook", "fp16"}, "--comm-hook: is DDP's"},
      {{"--resume"}, "--resume needs --checkpoint-dir"},
      {{"--checkpoint-every", "5"}, "--checkpoint-every needs --checkpoint-dir"},
      {{"--dataset", "mnist"}, "--dataset mnist needs --data-dir"},
      {{"--dataset", "synthetic", "--data-dir", "/tmp"}, "--data-dir"},
      {{"--progress", "fancy"}, "--progress"},
      {{"--comm-hook", "zip"}, "--comm-hook"},
      {{"--device", "tpu"}, "--device"},
      {{"--no-such-flag"}, "--no-such-flag"},
      {{"--train-samples", "10", "--batch-size", "64", "--steps", "1"},
       "fewer than one step needs"},
      {{"--pp-stages", "2"}, "--pp-stages 2 does not divide the world size 1"},
      {{"--pp-stages", "2", "--strategy", "zero1"}, "--strategy zero1 is not supported with it"},
      {{"--pp-stages", "2", "--strategy", "fsdp", "--reshard-after-forward", "false"},
       "--reshard-after-forward does not apply to --pp-stages > 1"},
      {{"--pp-stages", "2", "--microbatches", "3"},
       "--microbatches 3 does not divide --batch-size 64"},
      {{"--pp-stages", "2", "--schedule", "zbv"}, "--schedule"},
      {{"--pp-stages", "0"}, "--pp-stages"},
      {{"--microbatches", "2"}, "--microbatches and --schedule apply to --pp-stages > 1 only"},
  };
  for (const auto& c : cases) {
    auto r = train(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args[0] << ": " << r.describe();
    EXPECT_TRUE(contains(r.err, c.message)) << "'" << c.message << "' not in: " << r.err;
  }
}

// A small tree of Python-like files for --dataset text (deterministic; `files` of them, the
// last held out when there are fewer than 20).
std::string write_text_dir(int files, int lines_per_file) {
  const std::string dir = test::temp_dir();
  ::mkdir((dir + "/pkg").c_str(), 0755);
  for (int f = 0; f < files; ++f) {
    std::ofstream out(dir + (f % 2 ? "/pkg/mod" : "/mod") + std::to_string(f) + ".py");
    for (int i = 0; i < lines_per_file; ++i) {
      out << "def f_" << f << "_" << i << "(x, y=" << (i * 7 + f) % 13 << "):\n"
          << "    return x * " << i % 5 << " + y  # line " << i << "\n";
    }
  }
  std::ofstream(dir + "/notes.txt") << "not python: left out\n";
  return dir;
}

// Every match of `pattern` in what rank 0 printed (a log line's loss, the evaluations' figures),
// one per line.
std::string printed(const std::string& out, const std::string& pattern) {
  std::string all;
  const std::regex re(pattern);
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it) {
    all += it->str() + "\n";
  }
  return all.empty() ? "(not found: " + pattern + ")" : all;
}

int64_t held(const nlohmann::json& m) {
  return m["parameter_bytes"].get<int64_t>() + m["gradient_bytes"].get<int64_t>() +
         m["optimizer_state_bytes"].get<int64_t>();
}

// The loss of every "train" event in a --metrics file, in order.
std::vector<double> train_losses(const std::string& metrics_path) {
  std::vector<double> out;
  for (const auto& l : read_json_lines(metrics_path)) {
    if (l["event"] == "train") out.push_back(l["loss"].get<double>());
  }
  return out;
}

// tdist-train's arguments for the tests' small gpt (2 blocks of width 32, 2 heads, context 32)
// on `text`: batch 4, Adam, one thread, `steps` steps, logging every `log_every`, evaluating on
// `test_samples` held-out samples.
std::vector<std::string> small_gpt_args(const std::string& text, int steps, int log_every,
                                        int test_samples) {
  // clang-format off
  return {"--model", "gpt", "--layers", "2", "--width", "32", "--heads", "2", "--context", "32",
          "--data-dir", text, "--batch-size", "4", "--steps", std::to_string(steps),
          "--log-every", std::to_string(log_every), "--optimizer", "adam", "--lr", "0.003",
          "--seed", "3", "--test-samples", std::to_string(test_samples), "--eval-batch-size", "2",
          "--progress", "log", "--threads", "1"};
  // clang-format on
}

// The same short gpt run at world 2 under each strategy: every run ends with equal parameters
// on both ranks, and with the loss and held-out loss ddp printed (to the printed digits); the
// memory each rank reports, measured from its tensors, is sharded as the strategy says. The
// evaluation (after step 3 and at the end) gives the ranks unequal batch counts. At world
// 2 the parameters are even bit-equal to ddp's: fsdp's a/2 + b/2 and DDP's (a + b)/2 are the same
// floats (halving is exact), Adam is elementwise, and zero1 steps the same Adam per parameter.
TEST(TdistTrain, GptUnderFsdpAndZero1EndsWithDdpsLossAndShardedMemory) {
  const std::string text = write_text_dir(5, 120);
  const std::string dir = test::temp_dir();
  auto run = [&](const std::string& name, std::vector<std::string> extra) {
    std::vector<std::string> args = small_gpt_args(text, 6, 3, 5);
    args.insert(args.end(), {"--eval-every", "3", "--summary", dir + "/" + name + ".json"});
    args.insert(args.end(), extra.begin(), extra.end());
    auto r = train_under_run(2, {}, args);
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.describe();
    auto hashes = final_hashes(r.out);
    EXPECT_EQ(hashes.size(), 2u) << name << ": " << r.out;
    EXPECT_EQ(hashes[0], hashes[1]) << name << ": the ranks' parameters differ";
    return std::make_pair(r.out, read_json(dir + "/" + name + ".json"));
  };
  const auto [ddp_out, ddp] = run("ddp", {});
  ASSERT_EQ(ddp["strategy"], "ddp");
  // 2 blocks of width 32: 12 w^2 + 13 w each; embeddings 256 w + 32 w; ln_f 2 w; head 256 w.
  EXPECT_EQ(ddp["params"], 2 * (12 * 32 * 32 + 13 * 32) + 256 * 32 + 32 * 32 + 2 * 32 + 32 * 256);
  // 5 held-out windows in batches of 2: rank 0 runs 2 forwards, rank 1 one (under fsdp, where a
  // forward is a collective, rank 1 runs a second one on a sample it drops).
  EXPECT_EQ(ddp["eval_samples"], 5);
  EXPECT_NEAR(ddp["perplexity"].get<double>(), std::exp(ddp["eval_loss"].get<double>()), 1e-9);
  EXPECT_TRUE(contains(ddp_out, "held out")) << ddp_out;
  const std::string loss_at_6 = R"(step 6/6 epoch \d+: loss [0-9.]+)";
  const std::string eval = R"(held-out loss [0-9.]+, perplexity [0-9.]+)";
  const std::string ddp_evals = printed(ddp_out, eval);
  EXPECT_EQ(std::count(ddp_evals.begin(), ddp_evals.end(), '\n'), 2) << ddp_out;
  const int64_t ddp_bytes = held(ddp["memory_per_rank"][0]);
  const int64_t numel = ddp["params"].get<int64_t>();
  // DDP: 4 bytes of value, 4 of gradient and 8 of Adam state per parameter.
  EXPECT_EQ(ddp_bytes, 16 * numel) << ddp.dump(2);

  for (const char* reshard : {"true", "false"}) {
    const auto [out, s] = run(std::string("fsdp-") + reshard,
                              {"--strategy", "fsdp", "--reshard-after-forward", reshard});
    EXPECT_EQ(printed(out, loss_at_6), printed(ddp_out, loss_at_6)) << out;
    EXPECT_EQ(printed(out, eval), printed(ddp_out, eval)) << out;
    EXPECT_EQ(s["params_fnv1a64"], ddp["params_fnv1a64"]);
    EXPECT_EQ(s["strategy"], "fsdp");
    for (int r = 0; r < 2; ++r) {
      const auto& m = s["memory_per_rank"][r];
      // A half of everything, plus each group's padding to an even count (a few elements).
      EXPECT_LE(held(m), ddp_bytes / 2 + 16 * 8) << m;
      EXPECT_GE(held(m), ddp_bytes / 2) << m;
      EXPECT_GT(m["peak_rss_bytes"].get<int64_t>(), 0) << m;
      // The counting allocator saw at least what the rank holds at the end.
      EXPECT_GE(m["peak_allocated_bytes"].get<int64_t>(), held(m)) << m;
    }
  }
  // hsdp with shard groups of one rank replicates across both: DDP's arithmetic and memory.
  const auto [hout, h] = run("hsdp", {"--strategy", "hsdp", "--shard-size", "1"});
  EXPECT_EQ(printed(hout, loss_at_6), printed(ddp_out, loss_at_6)) << hout;
  EXPECT_EQ(printed(hout, eval), printed(ddp_out, eval)) << hout;
  EXPECT_EQ(h["params_fnv1a64"], ddp["params_fnv1a64"]);
  EXPECT_EQ(h["shard_size"], 1);
  EXPECT_EQ(held(h["memory_per_rank"][0]), ddp_bytes) << h.dump(2);
  // bf16 compute: both ranks end equal (checked by run) with a finite loss near ddp's.
  const auto [bout, b] = run("bf16", {"--strategy", "fsdp", "--mixed-precision", "bf16"});
  EXPECT_EQ(b["mixed_precision"], "bf16");
  EXPECT_NEAR(b["eval_loss"].get<double>(), ddp["eval_loss"].get<double>(), 0.1) << bout;
  const auto [zout, z] = run("zero1", {"--strategy", "zero1"});
  EXPECT_EQ(printed(zout, loss_at_6), printed(ddp_out, loss_at_6)) << zout;
  EXPECT_EQ(printed(zout, eval), printed(ddp_out, eval)) << zout;
  EXPECT_EQ(z["params_fnv1a64"], ddp["params_fnv1a64"]);
  const auto& z0 = z["memory_per_rank"][0];
  const auto& z1 = z["memory_per_rank"][1];
  // Whole parameters and gradients; the Adam state split between the ranks.
  EXPECT_EQ(z0["parameter_bytes"], 4 * numel);
  EXPECT_EQ(z0["gradient_bytes"], 4 * numel);
  EXPECT_EQ(z0["optimizer_state_bytes"].get<int64_t>() + z1["optimizer_state_bytes"].get<int64_t>(),
            8 * numel);
  EXPECT_LT(z0["optimizer_state_bytes"].get<int64_t>(), 8 * numel * 3 / 4) << z0;
  EXPECT_LT(z1["optimizer_state_bytes"].get<int64_t>(), 8 * numel * 3 / 4) << z1;
}

// --pp-stages: a pipeline trains with the losses of the same run without one, step by step (to
// float rounding: the microbatches' means are added in another order). A gpt in 2 stages x 2
// replicas (world 4, zero-bubble, DDP across the replicas) against DDP at world 2 (the same
// samples per replica), the same under fsdp in bf16 within bf16's rounding, and 2 stages x 4
// replicas under hsdp (world 8) against DDP at world 4; an mlp in 2 stages with two chunks each
// (interleaved, world 2) against one process. Evaluation through the pipeline gives the same
// test loss and accuracy. After each run every rank holds the same whole model (the stages'
// parts are gathered for the final hash).
TEST(TdistTrain, PipelineStagesTrainWithTheLossesOfOneStage) {
  const std::string text = write_text_dir(5, 120);
  const std::string dir = test::temp_dir();
  auto run = [&](const std::string& name, int nproc, std::vector<std::string> args) {
    const std::vector<std::string> common = {"--steps",     "4",
                                             "--log-every", "1",
                                             "--progress",  "log",
                                             "--metrics",   dir + "/" + name + ".jsonl",
                                             "--summary",   dir + "/" + name + ".json"};
    args.insert(args.end(), common.begin(), common.end());
    if (nproc > 1) args.insert(args.end(), {"--threads", "1"});  // train() adds it alone
    auto r = nproc == 1 ? train(args) : train_under_run(nproc, {}, args);
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.describe();
    auto hashes = final_hashes(r.out);
    EXPECT_EQ(hashes.size(), static_cast<size_t>(nproc)) << name << ": " << r.out;
    for (const auto& [rank, hash] : hashes) {
      EXPECT_EQ(hash, hashes[0]) << name << ": rank " << rank << "'s model differs";
    }
    const std::vector<double> losses = train_losses(dir + "/" + name + ".jsonl");
    EXPECT_EQ(losses.size(), 4u) << name << ": " << r.out;
    return std::make_pair(losses, read_json(dir + "/" + name + ".json"));
  };
  auto expect_same_losses = [](const std::vector<double>& a, const std::vector<double>& b,
                               const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_NEAR(a[i], b[i], 1e-4 * std::max(1.0, std::abs(b[i]))) << what << " step " << i + 1;
    }
  };
  const std::vector<std::string> gpt = {
      "--model",   "gpt",   "--layers",   "2",  "--width",        "32", "--heads",           "2",
      "--context", "32",    "--data-dir", text, "--batch-size",   "4",  "--optimizer",       "adam",
      "--lr",      "0.003", "--seed",     "3",  "--test-samples", "5",  "--eval-batch-size", "2"};
  auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const auto [ddp, ddp_s] = run("gpt-ddp", 2, gpt);
  const auto [pp, pp_s] =
      run("gpt-pp", 4, with(gpt, {"--pp-stages", "2", "--schedule", "zb", "--microbatches", "2"}));
  expect_same_losses(pp, ddp, "gpt, 2 stages x 2 replicas (zb) against ddp at world 2");
  EXPECT_EQ(pp_s["pp_stages"], 2);
  EXPECT_EQ(pp_s["schedule"], "zb");
  // Evaluated through the pipelines: each replica's share of the 5 samples in batches of 4,
  // filled up with repeats that are not counted.
  EXPECT_NEAR(pp_s["eval_loss"].get<double>(), ddp_s["eval_loss"].get<double>(), 1e-4);
  EXPECT_EQ(pp_s["eval_samples"], 5);
  // The same predictions, but where float rounding flips one of the 160 (5 windows of 32).
  EXPECT_NEAR(pp_s["accuracy"].get<double>(), ddp_s["accuracy"].get<double>(), 1.0 / 160);
  // Each rank holds its stage's parameters only: a pipeline's two stages (world ranks 0 and 2,
  // Note [Device mesh layout]) hold the whole model between them.
  const auto& memory = pp_s["memory_per_rank"];
  ASSERT_EQ(memory.size(), 4u);
  const int64_t whole = 4 * pp_s["params"].get<int64_t>();  // fp32
  EXPECT_EQ(
      memory[0]["parameter_bytes"].get<int64_t>() + memory[2]["parameter_bytes"].get<int64_t>(),
      whole)
      << memory;
  EXPECT_EQ(memory[1]["parameter_bytes"], memory[0]["parameter_bytes"]);

  // bf16 per stage (each stage sharded across its 2 replicas, gathered and computed in bf16,
  // activations sent as bf16; zero-bubble, whose weight pass runs apart): DDP's losses within
  // bf16's rounding, and not DDP's exactly.
  const auto [bf16, bf16_s] =
      run("gpt-pp-bf16", 4,
          with(gpt, {"--pp-stages", "2", "--schedule", "zb", "--microbatches", "2", "--strategy",
                     "fsdp", "--mixed-precision", "bf16"}));
  ASSERT_EQ(bf16.size(), ddp.size());
  double furthest = 0;
  for (size_t i = 0; i < ddp.size(); ++i) {
    EXPECT_NEAR(bf16[i], ddp[i], 0.05) << "bf16 step " << i + 1;
    furthest = std::max(furthest, std::abs(bf16[i] - ddp[i]));
  }
  EXPECT_GT(furthest, 1e-4) << "the bf16 pipeline computed DDP's fp32 losses";
  EXPECT_EQ(bf16_s["mixed_precision"], "bf16");
  EXPECT_NEAR(bf16_s["eval_loss"].get<double>(), ddp_s["eval_loss"].get<double>(), 0.1);

  // HSDP per stage: 2 stages x 4 replicas at world 8, each stage sharded within pairs of
  // replicas and replicated across the pairs, against DDP at world 4 (4 replicas).
  const auto [ddp4, ddp4_s] = run("gpt-ddp4", 4, gpt);
  const auto [hsdp, hsdp_s] = run("gpt-pp-hsdp", 8,
                                  with(gpt, {"--pp-stages", "2", "--microbatches", "2",
                                             "--strategy", "hsdp", "--shard-size", "2"}));
  expect_same_losses(hsdp, ddp4, "gpt, 2 stages x (2 x 2 hsdp) against ddp at world 4");
  EXPECT_NEAR(hsdp_s["eval_loss"].get<double>(), ddp4_s["eval_loss"].get<double>(), 1e-4);
  // A stage's shard group (world ranks 0 and 1, then 2 and 3 its other replica pair) holds the
  // stage once: half of what the stage's rank held above, give or take a shard's padding.
  const auto& hm = hsdp_s["memory_per_rank"];
  ASSERT_EQ(hm.size(), 8u);
  const int64_t stage0 = memory[0]["parameter_bytes"].get<int64_t>();
  EXPECT_GE(hm[0]["parameter_bytes"].get<int64_t>() + hm[1]["parameter_bytes"].get<int64_t>(),
            stage0)
      << hm;
  EXPECT_LE(hm[0]["parameter_bytes"].get<int64_t>(), stage0 / 2 + 64) << hm;
  EXPECT_EQ(hm[2]["parameter_bytes"], hm[0]["parameter_bytes"]) << hm;

  const std::vector<std::string> mlp = {"--dataset",      "synthetic", "--model",         "mlp",
                                        "--hidden",       "32",        "--layers",        "3",
                                        "--batch-size",   "16",        "--train-samples", "256",
                                        "--test-samples", "64",        "--seed",          "5"};
  const auto [alone, alone_s] = run("mlp-alone", 1, mlp);
  const auto [inter, inter_s] =
      run("mlp-pp", 2,
          with(mlp, {"--pp-stages", "2", "--schedule", "interleaved", "--microbatches", "4"}));
  expect_same_losses(inter, alone, "mlp, 2 stages of 2 chunks (interleaved) against one process");
  EXPECT_NEAR(inter_s["accuracy"].get<double>(), alone_s["accuracy"].get<double>(), 1e-9);

  // Shard groups that do not divide a stage's replicas (1 at world 2): refused on every rank.
  auto uneven = train_under_run(2, {},
                                with(gpt, {"--pp-stages", "2", "--strategy", "hsdp", "--shard-size",
                                           "2", "--steps", "1", "--threads", "1"}));
  EXPECT_NE(uneven.exit_code, 0) << uneven.describe();
  EXPECT_TRUE(contains(uneven.out + uneven.err,
                       "--shard-size 2 does not divide the 1 data-parallel replicas"))
      << uneven.describe();

  // A cut that cannot be made: more stages than the gpt has blocks, on every rank.
  std::vector<std::string> one_block = gpt;
  one_block[3] = "1";  // --layers 1
  auto r = train_under_run(2, {},
                           with(one_block, {"--pp-stages", "2", "--steps", "1", "--threads", "1"}));
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_TRUE(contains(r.out + r.err, "the model has 1 blocks, fewer than the 2 pipeline stages"))
      << r.describe();
}

// Note [Pipelined checkpoints], the elastic case: under DDP a pipelined run resumes with another
// number of replicas. 2 stages x 2 replicas (world 4) for 2 steps, resumed as 2 x 1 (world 2)
// to step 4, trains with the losses of DDP without stages at world 2 resumed at world 1 (the
// same samples per replica in each step: the pipeline equals DDP to float rounding).
TEST(TdistTrain, PipelinedDdpCheckpointResumesWithAnotherNumberOfReplicas) {
  const std::string text = write_text_dir(5, 120);
  const auto args = [&](const std::string& dir, int steps, bool pipelined) {
    std::vector<std::string> a = small_gpt_args(text, steps, 1, 4);
    a.insert(a.end(),
             {"--metrics", dir + "/metrics.jsonl", "--checkpoint-dir", dir + "/ckpt", "--resume"});
    if (pipelined) a.insert(a.end(), {"--pp-stages", "2", "--microbatches", "2"});
    return a;
  };
  const auto losses = [](const std::string& dir) { return train_losses(dir + "/metrics.jsonl"); };
  const std::string pp = test::temp_dir(), ddp = test::temp_dir();
  ASSERT_EQ(train_under_run(4, {}, args(pp, 2, true)).exit_code, 0);
  auto resumed = train_under_run(2, {}, args(pp, 4, true));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.describe();
  EXPECT_TRUE(contains(resumed.out, "(written by 2 replicas of each stage; 1 now)")) << resumed.out;
  ASSERT_EQ(train_under_run(2, {}, args(ddp, 2, false)).exit_code, 0);
  auto ddp_resumed = train_under_run(1, {}, args(ddp, 4, false));
  ASSERT_EQ(ddp_resumed.exit_code, 0) << ddp_resumed.describe();
  const auto want = losses(ddp), got = losses(pp);
  ASSERT_EQ(want.size(), 4u);
  ASSERT_EQ(got.size(), 4u);
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 1e-4 * std::max(1.0, std::abs(want[i]))) << "step " << i + 1;
  }
  // Both ranks of the resumed run end with the same whole model.
  auto hashes = final_hashes(resumed.out);
  ASSERT_EQ(hashes.size(), 2u) << resumed.out;
  EXPECT_EQ(hashes[0], hashes[1]);
}

// Note [Pipelined checkpoints]: a gpt in 2 stages x 2 replicas, each stage sharded across its
// replicas (--strategy fsdp), stopped after 2 steps and resumed to 4 ends as the uninterrupted
// 4-step run does: the same losses and bit-equal parameters; each rank wrote its part and
// holds about a quarter of the model. Resuming under another layout is refused naming both,
// at another world size or without a rank's part likewise, and a rank that cannot write its
// part fails the checkpoint on every rank, naming it.
TEST(TdistTrain, PipelinedCheckpointResumesWithTheUninterruptedLosses) {
  const std::string text = write_text_dir(5, 120);
  const auto args = [&](const std::string& dir, int steps, const std::string& strategy) {
    std::vector<std::string> a = small_gpt_args(text, steps, 1, 4);
    a.insert(a.end(), {"--pp-stages", "2", "--microbatches", "2", "--strategy", strategy,
                       "--metrics", dir + "/metrics.jsonl", "--summary", dir + "/summary.json",
                       "--checkpoint-dir", dir + "/ckpt", "--resume"});
    return a;
  };
  const auto losses = [](const std::string& dir) { return train_losses(dir + "/metrics.jsonl"); };
  const std::string whole = test::temp_dir(), cut = test::temp_dir();
  auto uninterrupted = train_under_run(4, {}, args(whole, 4, "fsdp"));
  ASSERT_EQ(uninterrupted.exit_code, 0) << uninterrupted.describe();
  ASSERT_EQ(train_under_run(4, {}, args(cut, 2, "fsdp")).exit_code, 0);
  auto resumed = train_under_run(4, {}, args(cut, 4, "fsdp"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.describe();
  EXPECT_TRUE(contains(resumed.out,
                       "loaded every rank's part of the pipeline from " + cut + "/ckpt/pipeline-2"))
      << resumed.out;
  EXPECT_EQ(losses(cut), losses(whole));  // the resumed run appends to the metrics file
  EXPECT_EQ(final_hashes(resumed.out), final_hashes(uninterrupted.out)) << resumed.out;
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(std::filesystem::exists(cut + "/ckpt/pipeline-4/rank-" + std::to_string(r) +
                                        "/checkpoint.pt"))
        << r;
  }
  EXPECT_FALSE(std::filesystem::exists(cut + "/ckpt/pipeline-2")) << "an old checkpoint was kept";
  // Sharded stages: the four ranks hold the model once between them (with a few elements of
  // padding per shard group), a quarter each.
  const auto summary = read_json(whole + "/summary.json");
  const int64_t model_bytes = 4 * summary["params"].get<int64_t>();
  int64_t held = 0;
  for (const auto& m : summary["memory_per_rank"]) {
    held += m["parameter_bytes"].get<int64_t>();
    EXPECT_LT(m["parameter_bytes"].get<int64_t>(), model_bytes * 3 / 10) << m;
  }
  EXPECT_GE(held, model_bytes);
  EXPECT_LT(held, model_bytes + 64);

  // Another layout (DDP across the replicas): refused, both fingerprints shown.
  auto other = train_under_run(4, {}, args(cut, 6, "ddp"));
  EXPECT_NE(other.exit_code, 0) << other.describe();
  EXPECT_TRUE(contains(other.out + other.err, "pipeline=2/1f1b/fsdp")) << other.describe();
  EXPECT_TRUE(contains(other.out + other.err, "pipeline=2/1f1b/ddp")) << other.describe();

  // Another world size: refused, saying why. A part that is gone: refused, naming its rank.
  auto smaller = train_under_run(2, {}, args(cut, 6, "fsdp"));
  EXPECT_NE(smaller.exit_code, 0) << smaller.describe();
  EXPECT_TRUE(contains(smaller.out + smaller.err,
                       "the checkpoint was written at world size 4; a "
                       "pipelined run resumes at the world size"))
      << smaller.describe();
  EXPECT_TRUE(
      contains(smaller.out + smaller.err, "under --strategy fsdp (under ddp at any world size)"))
      << smaller.describe();
  std::filesystem::remove_all(cut + "/ckpt/pipeline-4/rank-3");
  auto missing = train_under_run(4, {}, args(cut, 6, "fsdp"));
  EXPECT_NE(missing.exit_code, 0) << missing.describe();
  EXPECT_TRUE(
      contains(missing.out + missing.err, "the pipelined checkpoint has no part for rank 3"))
      << missing.describe();

  // Rank 1 cannot write its part (a file where its directory goes): every rank fails, naming it.
  const std::string blocked = test::temp_dir();
  std::filesystem::create_directories(blocked + "/ckpt/pipeline-1");
  std::ofstream(blocked + "/ckpt/pipeline-1/rank-1") << "not a directory";
  auto failed = train_under_run(4, {}, args(blocked, 1, "fsdp"));
  EXPECT_NE(failed.exit_code, 0) << failed.describe();
  EXPECT_TRUE(contains(failed.out + failed.err, "was not written: rank(s) 1 failed"))
      << failed.describe();
  EXPECT_FALSE(std::filesystem::exists(blocked + "/ckpt/checkpoint.pt"));
}

// tdist-train's arguments for the checkpoint tests' small gpt on `text`: `steps` steps under
// `strategy`, checkpointing into and resuming from `dir`.
std::vector<std::string> gpt_checkpoint_args(const std::string& text, const std::string& strategy,
                                             const std::string& dir, int steps) {
  std::vector<std::string> args = small_gpt_args(text, steps, 2, 4);
  args.insert(args.end(), {"--strategy", strategy, "--checkpoint-dir", dir, "--resume"});
  return args;
}
const char* const kLossAtStep8 = R"(step 8/8 epoch \d+: loss [0-9.]+)";
const char* const kHeldOut = R"(held-out loss [0-9.]+, perplexity [0-9.]+)";

// Note [Checkpoint protocol] 6: under fsdp the model and Adam's state go into a sharded
// checkpoint. Saved at world 2 after 4 steps and resumed at world 3 (each rank reading parts of
// the world-2 shards), the run prints the losses ddp prints through the same history (ddp's own
// resume at another world size is tested above); resumed at world 2 it ends bit-equal to an
// uninterrupted fsdp run. Only the last sharded checkpoint is kept; a checkpoint of one kind is
// refused by the other.
TEST(TdistTrain, FsdpCheckpointSavedAtWorld2ResumesAtWorld3WithDdpsLosses) {
  const std::string text = write_text_dir(5, 120);
  const auto args = [&](const std::string& strategy, const std::string& dir, int steps) {
    return gpt_checkpoint_args(text, strategy, dir, steps);
  };
  // train() gives --threads 1 itself.
  const auto alone = [](std::vector<std::string> a) {
    auto it = std::find(a.begin(), a.end(), "--threads");
    a.erase(it, it + 2);
    return a;
  };
  const std::string loss_at_8 = kLossAtStep8, eval = kHeldOut;
  std::map<std::string, std::string> out;
  for (const std::string strategy : {"ddp", "fsdp"}) {
    const std::string dir = test::temp_dir();
    auto first = train_under_run(2, {}, args(strategy, dir, 4));
    ASSERT_EQ(first.exit_code, 0) << strategy << ": " << first.describe();
    auto resumed = train_under_run(3, {}, args(strategy, dir, 8));
    ASSERT_EQ(resumed.exit_code, 0) << strategy << ": " << resumed.describe();
    EXPECT_TRUE(contains(resumed.out, "resumed from " + dir + "/checkpoint.pt at step 4"))
        << resumed.out;
    out[strategy] = resumed.out;
    if (strategy == "fsdp") {
      EXPECT_TRUE(contains(resumed.out,
                           "loaded the sharded model and optimizer from " + dir + "/sharded-4"))
          << resumed.out;
      EXPECT_FALSE(std::filesystem::exists(dir + "/sharded-4")) << "an old checkpoint was kept";
      EXPECT_TRUE(std::filesystem::exists(dir + "/sharded-8/index.json"));
      // A sharded checkpoint is not ddp's, and the other way round: exit 2, saying which.
      auto as_ddp = train(alone(args("ddp", dir, 10)));
      EXPECT_EQ(as_ddp.exit_code, 2) << as_ddp.describe();
      EXPECT_TRUE(contains(as_ddp.err, "written under --strategy fsdp or hsdp")) << as_ddp.err;
    } else {
      auto as_fsdp = train(alone(args("fsdp", dir, 10)));
      EXPECT_EQ(as_fsdp.exit_code, 2) << as_fsdp.describe();
      EXPECT_TRUE(contains(as_fsdp.err, "written under --strategy ddp")) << as_fsdp.err;
    }
  }
  EXPECT_EQ(printed(out["fsdp"], loss_at_8), printed(out["ddp"], loss_at_8)) << out["fsdp"];
  EXPECT_EQ(printed(out["fsdp"], eval), printed(out["ddp"], eval)) << out["fsdp"];

  const std::string interrupted = test::temp_dir(), whole = test::temp_dir();
  ASSERT_EQ(train_under_run(2, {}, args("fsdp", interrupted, 4)).exit_code, 0);
  auto resumed = train_under_run(2, {}, args("fsdp", interrupted, 8));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.describe();
  auto uninterrupted = train_under_run(2, {}, args("fsdp", whole, 8));
  ASSERT_EQ(uninterrupted.exit_code, 0) << uninterrupted.describe();
  EXPECT_EQ(final_hashes(resumed.out), final_hashes(uninterrupted.out)) << resumed.out;
  EXPECT_EQ(printed(resumed.out, loss_at_8), printed(uninterrupted.out, loss_at_8));

  // checkpoint.pt records its sharded index's digest (Note [Checkpoint key]): an index changed
  // afterwards, though every shard still matches it, is refused.
  std::ofstream(interrupted + "/sharded-8/index.json", std::ios::app) << " ";
  auto changed = train_under_run(2, {}, args("fsdp", interrupted, 10));
  EXPECT_NE(changed.exit_code, 0) << changed.describe();
  EXPECT_TRUE(contains(changed.out + changed.err, "is not the index checkpoint.pt recorded"))
      << changed.describe();
}

// --strategy zero1 writes ddp's checkpoint: the whole optimizer, gathered to rank 0 (Note
// [ZeRO-1] 5). Saved at world 2 after 4 steps and resumed at world 3 (another partition of the
// Adam state), it prints the losses of ddp resumed from the same checkpoint and ends with its
// parameters; resumed at world 2 it ends bit-equal to an uninterrupted zero1 run (a state lost
// or misplaced in the save would show here).
TEST(TdistTrain, Zero1CheckpointSavedAtWorld2ResumesAtWorld3WithDdpsLosses) {
  const std::string text = write_text_dir(5, 120);
  const auto args = [&](const std::string& strategy, const std::string& dir, int steps) {
    return gpt_checkpoint_args(text, strategy, dir, steps);
  };
  const std::string loss_at_8 = kLossAtStep8, eval = kHeldOut;
  const std::string saved = test::temp_dir();
  auto first = train_under_run(2, {}, args("zero1", saved, 4));
  ASSERT_EQ(first.exit_code, 0) << first.describe();
  ASSERT_TRUE(std::filesystem::exists(saved + "/checkpoint.pt")) << first.out;
  std::map<std::string, CommandResult> resumed;
  for (const std::string strategy : {"zero1", "ddp"}) {
    const std::string dir = test::temp_dir();
    std::filesystem::copy(saved, dir, std::filesystem::copy_options::recursive);
    resumed[strategy] = train_under_run(3, {}, args(strategy, dir, 8));
    const auto& r = resumed[strategy];
    ASSERT_EQ(r.exit_code, 0) << strategy << ": " << r.describe();
    EXPECT_TRUE(contains(r.out, "resumed from " + dir + "/checkpoint.pt at step 4")) << r.out;
    EXPECT_TRUE(contains(r.out, "the checkpoint was written at world size 2")) << r.out;
  }
  const std::string& z = resumed["zero1"].out;
  const std::string& d = resumed["ddp"].out;
  ASSERT_FALSE(contains(printed(z, loss_at_8), "not found")) << z;
  EXPECT_EQ(printed(z, loss_at_8), printed(d, loss_at_8)) << z;
  EXPECT_EQ(printed(z, eval), printed(d, eval)) << z;
  EXPECT_EQ(final_hashes(z), final_hashes(d)) << z;

  const std::string whole = test::temp_dir();
  auto at_world_2 = train_under_run(2, {}, args("zero1", saved, 8));
  ASSERT_EQ(at_world_2.exit_code, 0) << at_world_2.describe();
  auto uninterrupted = train_under_run(2, {}, args("zero1", whole, 8));
  ASSERT_EQ(uninterrupted.exit_code, 0) << uninterrupted.describe();
  EXPECT_EQ(final_hashes(at_world_2.out).size(), 2u) << at_world_2.out;
  EXPECT_EQ(final_hashes(at_world_2.out), final_hashes(uninterrupted.out)) << at_world_2.out;
  EXPECT_EQ(printed(at_world_2.out, loss_at_8), printed(uninterrupted.out, loss_at_8));
}

TEST(TdistTrain, GptLearnsThePythonStandardLibrary) {
  const std::string dir = test::temp_dir();
  auto r = train({"--model",     "gpt", "--layers",       "1",    "--width",      "64",
                  "--heads",     "2",   "--context",      "64",   "--batch-size", "16",
                  "--steps",     "30",  "--optimizer",    "adam", "--lr",         "0.01",
                  "--log-every", "10",  "--test-samples", "32",   "--summary",    dir + "/s.json",
                  "--progress",  "log"});
  if (r.exit_code == 2 && contains(r.err, "no Python standard library")) {
    GTEST_SKIP() << r.err;
  }
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto s = read_json(dir + "/s.json");
  EXPECT_TRUE(contains(s["dataset"].get<std::string>(), "/usr/lib/python3.")) << s["dataset"];
  // Better than a uniform guess over 256 bytes (perplexity 256).
  EXPECT_LT(s["perplexity"].get<double>(), 64.0) << s.dump(2);
  EXPECT_TRUE(contains(r.out, "perplexity")) << r.out;
}

TEST(TdistTrain, BadTextDirectoriesGiveClearErrors) {
  const std::string one = write_text_dir(1, 10);
  auto r = train({"--model", "gpt", "--data-dir", one, "--steps", "1"});
  EXPECT_EQ(r.exit_code, 2) << r.describe();
  EXPECT_TRUE(contains(r.err, "holds 1 .py file(s); --dataset text needs at least 2")) << r.err;
  const std::string tiny = write_text_dir(2, 1);
  r = train({"--model", "gpt", "--data-dir", tiny, "--context", "512", "--steps", "1"});
  EXPECT_EQ(r.exit_code, 2) << r.describe();
  EXPECT_TRUE(contains(r.err, "fewer than one sample of --context 512 needs")) << r.err;
}

}  // namespace
}  // namespace tdist
