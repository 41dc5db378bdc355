// Sharded checkpoints (Note [Sharded checkpoints]) and consolidated safetensors of a
// FullyShardedModule: saved at world 4 and resumed at worlds 2 and 3 by real processes, with
// the losses of an uninterrupted run; damaged, truncated and missing files and mismatched
// models refused with clear errors on every rank (ranks as threads).
#include "tdist/fsdp/checkpoint.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <regex>

#include "tdist/core/error.h"
#include "tdist/core/rendezvous.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/harness/net.h"
#include "tests/harness/process.h"

namespace tdist::test {
namespace {

constexpr int kCkptSteps = 6;  // 3 before the checkpoint, 3 after
constexpr int kSaveAt = 3;
constexpr int kRows = 12;  // divides by 2, 3 and 4
constexpr uint64_t kDataSeed = 7;

torch::Tensor stat_value() { return torch::tensor({1.5, -2.0}); }

// One rank of a run. TDIST_CKPT_PHASE=save: steps [0, kSaveAt) from a fresh model, then a
// sharded checkpoint into TDIST_CKPT_DIR; load: a model initialised otherwise, the checkpoint
// loaded, steps [kSaveAt, kCkptSteps). Prints "LOSS <step> <global loss>" per step.
TDIST_TEST_CHILD(fsdp_ckpt_child) {
  torch::set_num_threads(1);
  const std::string dir = std::getenv("TDIST_CKPT_DIR");
  const bool load = std::string(std::getenv("TDIST_CKPT_PHASE")) == "load";
  auto pg = env_process_group(std::chrono::seconds(30));
  torch::manual_seed(load ? 999 : 1);
  Net net;
  net->register_buffer("stat", load ? torch::zeros({2}) : stat_value());
  auto batches = make_batches(kCkptSteps, kRows, kDataSeed);
  auto model = fsdp::fully_shard(net, units_of(net), pg);
  torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(kLr));
  if (load) {
    fsdp::load_sharded_checkpoint(dir, model, &opt);
    if (!torch::equal(net->named_buffers()["stat"], stat_value())) {
      std::cout << "the buffer was not loaded" << std::endl;
      return 4;
    }
  }
  for (int step = load ? kSaveAt : 0; step < (load ? kCkptSteps : kSaveAt); ++step) {
    const auto x = rows_of(batches[step].x, rank, world_size);
    const auto y = rows_of(batches[step].y, rank, world_size);
    opt.zero_grad();
    auto loss = torch::mse_loss(model(x), y);
    loss.backward();
    opt.step();
    auto global = loss.detach().clone();
    pg->allreduce(global)->wait();
    char line[64];
    std::snprintf(line, sizeof(line), "LOSS %d %.9g", step, global.item<double>() / world_size);
    std::cout << line << std::endl;
  }
  if (!load) fsdp::save_sharded_checkpoint(dir, model, &opt);
  return 0;
}

// The uninterrupted run: one process, the whole batch, the same initial values and Adam.
std::vector<double> reference_losses() {
  torch::manual_seed(1);
  Net net;
  auto batches = make_batches(kCkptSteps, kRows, kDataSeed);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(kLr));
  std::vector<double> out;
  for (int step = 0; step < kCkptSteps; ++step) {
    opt.zero_grad();
    auto loss = torch::mse_loss(net->forward(batches[step].x), batches[step].y);
    loss.backward();
    opt.step();
    out.push_back(loss.item<double>());
  }
  return out;
}

std::map<int, double> run_phase(const std::string& phase, int world, const std::string& dir) {
  Processes procs("fsdp_ckpt_child", world,
                  {{"MASTER_ADDR", "127.0.0.1"},
                   {"MASTER_PORT", std::to_string(free_port())},
                   {"OMP_NUM_THREADS", "1"},
                   {"TDIST_CKPT_DIR", dir},
                   {"TDIST_CKPT_PHASE", phase}});
  auto results = procs.wait_all(std::chrono::seconds(90));
  const std::string failures = Processes::failures(results);
  EXPECT_TRUE(failures.empty()) << phase << " at world " << world << ":\n" << failures;
  std::map<int, double> losses;
  std::regex line(R"(LOSS (\d+) (\S+))");
  for (std::sregex_iterator it(results[0].output.begin(), results[0].output.end(), line), end;
       it != end; ++it) {
    losses[std::stoi((*it)[1])] = std::stod((*it)[2]);
  }
  return losses;
}

void expect_losses(const std::map<int, double>& got, const std::vector<double>& want, int from,
                   int to, const std::string& what) {
  for (int s = from; s < to; ++s) {
    ASSERT_TRUE(got.count(s)) << what << ": no loss of step " << s;
    EXPECT_NEAR(got.at(s), want[s], 1e-5 * std::max(1.0, std::abs(want[s])))
        << what << ", step " << s;
  }
}

TEST(FSDPCheckpoint, SavedAtWorld4ResumesAtWorlds2And3WithTheUninterruptedLosses) {
  const auto want = reference_losses();
  const auto dir = temp_dir();
  expect_losses(run_phase("save", 4, dir), want, 0, kSaveAt, "world 4 before saving");
  ASSERT_TRUE(std::filesystem::exists(dir + "/" + fsdp::kIndexFile));
  expect_losses(run_phase("load", 2, dir), want, kSaveAt, kCkptSteps, "resumed at world 2");
  expect_losses(run_phase("load", 3, dir), want, kSaveAt, kCkptSteps, "resumed at world 3");
}

// ---- errors (ranks as threads) ----------------------------------------------------------------

constexpr int kWorld = 2;

// Trains two steps at world 2 and saves into `dir`.
void write_checkpoint(const std::string& dir) {
  auto batches = make_batches(2, 4, kDataSeed);
  spawn(kWorld, [&](int rank, std::shared_ptr<Store> store) {
    torch::manual_seed(1);
    Net net;
    auto model = fsdp::fully_shard(net, units_of(net), make_group(store, rank, kWorld));
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(kLr));
    for (const auto& b : batches) {
      opt.zero_grad();
      torch::mse_loss(model(rows_of(b.x, rank, kWorld)), rows_of(b.y, rank, kWorld)).backward();
      opt.step();
    }
    fsdp::save_sharded_checkpoint(dir, model, &opt);
  });
}

struct LoadOutcome {
  std::vector<std::string> errors;  // per rank; empty: it loaded
  bool unchanged = true;            // the model's values after the failed load are the ones before
};

// Every rank loads `dir` into a fresh model (units {fc1, mid, fc3}, or {fc1, fc3} when
// `other_units`) with an Adam (or SGD) optimizer.
LoadOutcome try_load(const std::string& dir, bool other_units = false, bool sgd = false) {
  LoadOutcome out;
  out.errors.resize(kWorld);
  std::mutex mu;
  spawn(kWorld, [&](int rank, std::shared_ptr<Store> store) {
    torch::manual_seed(2);
    Net net;
    std::vector<std::shared_ptr<torch::nn::Module>> units = units_of(net);
    if (other_units) units = {net->fc1.ptr(), net->fc3.ptr()};
    auto model = fsdp::fully_shard(net, units, make_group(store, rank, kWorld));
    auto opt = make_optimizer(model.parameters(), sgd);
    const auto before = full_values(model.full_parameters());
    try {
      fsdp::load_sharded_checkpoint(dir, model, opt.get());
    } catch (const Error& e) {
      std::lock_guard<std::mutex> lock(mu);
      out.errors[rank] = e.what();
    }
    const bool same = max_abs_diff(full_values(model.full_parameters()), before) == 0.0;
    std::lock_guard<std::mutex> lock(mu);
    if (!out.errors[rank].empty() && !same) out.unchanged = false;
  });
  return out;
}

std::string copy_of(const std::string& dir) {
  const auto to = temp_dir();
  std::filesystem::copy(dir, to, std::filesystem::copy_options::recursive);
  return to;
}

std::string shard_path(const std::string& dir, int rank) {
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const auto n = e.path().filename().string();
    if (n.rfind("shard-" + std::to_string(rank) + "-of-", 0) == 0) return e.path().string();
  }
  ADD_FAILURE() << "no shard file of rank " << rank << " in " << dir;
  return "";
}

void expect_all_fail(const LoadOutcome& o, const std::string& own, int failing_rank,
                     const std::string& what) {
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_FALSE(o.errors[r].empty()) << what << ": rank " << r << " loaded";
    if (failing_rank < 0 || r == failing_rank) {
      EXPECT_NE(o.errors[r].find(own), std::string::npos) << what << ": " << o.errors[r];
    } else {
      EXPECT_NE(o.errors[r].find("failed on rank " + std::to_string(failing_rank)),
                std::string::npos)
          << what << ": " << o.errors[r];
    }
  }
  EXPECT_TRUE(o.unchanged) << what << ": a failed load changed the model";
  std::cout << what << ":\n  rank 0: " << o.errors[0] << "\n  rank 1: " << o.errors[1] << "\n";
}

TEST(FSDPCheckpoint, DamagedMissingAndMismatchedCheckpointsAreClearErrors) {
  const auto good = temp_dir();
  write_checkpoint(good);
  write_checkpoint(good);  // a second save replaces the first: its shard files are removed
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(good)) {
    files += e.path().filename().string().rfind("shard-", 0) == 0;
  }
  EXPECT_EQ(files, kWorld);
  for (const auto& e : try_load(good).errors) EXPECT_TRUE(e.empty()) << e;

  expect_all_fail(try_load(temp_dir()), "no sharded checkpoint", -1, "empty directory");
  {
    const auto d = copy_of(good);
    std::filesystem::resize_file(d + "/index.json",
                                 std::filesystem::file_size(d + "/index.json") / 2);
    expect_all_fail(try_load(d), "is damaged: not JSON", -1, "truncated index");
  }
  {
    const auto d = copy_of(good);
    const auto p = shard_path(d, 1);
    std::filesystem::resize_file(p, std::filesystem::file_size(p) - 4);
    expect_all_fail(try_load(d), "truncated or replaced", 1, "truncated shard");
  }
  {
    const auto d = copy_of(good);
    std::filesystem::remove(shard_path(d, 0));
    expect_all_fail(try_load(d), "is missing", 0, "missing shard");
  }
  {
    const auto d = copy_of(good);
    const auto p = shard_path(d, 1);
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x40);
    f.seekp(-1, std::ios::end);
    f.write(&c, 1);
    f.close();
    expect_all_fail(try_load(d), "does not match its SHA-256", 1, "flipped byte");
  }
  expect_all_fail(try_load(good, /*other_units=*/true), "sharded units", -1, "other units");
  expect_all_fail(try_load(good, false, /*sgd=*/true), "the optimizer is sgd", -1, "SGD for Adam");
}

// ---- consolidated safetensors --------------------------------------------------------------------

TEST(FSDPCheckpoint, SafetensorsExportAtWorld2ImportsAtWorld3AndIntoAPlainModule) {
  const auto dir = temp_dir();
  const std::string path = dir + "/model.safetensors";
  auto batches = make_batches(2, 6, kDataSeed);
  std::vector<torch::Tensor> saved;
  spawn(2, [&](int rank, std::shared_ptr<Store> store) {
    torch::manual_seed(1);
    Net net;
    net->register_buffer("stat", stat_value());
    auto model = fsdp::fully_shard(net, units_of(net), make_group(store, rank, 2));
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(kLr));
    for (const auto& b : batches) {
      opt.zero_grad();
      torch::mse_loss(model(rows_of(b.x, rank, 2)), rows_of(b.y, rank, 2)).backward();
      opt.step();
    }
    fsdp::save_safetensors(model, path, {{"step", "2"}});
    auto full = full_values(model.full_parameters());
    if (rank == 0) saved = full;
  });
  // The file holds the full parameters by their module names, and the buffer.
  const auto file = fsdp::load_safetensors(path);
  torch::manual_seed(9);
  Net names;
  auto expected = names->named_parameters();
  ASSERT_EQ(file.size(), expected.size() + 1);
  std::vector<std::pair<std::string, torch::Tensor>> params(file.begin(), file.end() - 1);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].first, expected[i].key());
    EXPECT_TRUE(torch::equal(params[i].second, saved[i])) << params[i].first;
  }
  // Into a plain module.
  names->register_buffer("stat", torch::zeros({2}));
  fsdp::load_safetensors(*names, path);
  EXPECT_EQ(max_abs_diff(values_of(*names), saved), 0.0);
  // Into a sharded model at world 3: each rank takes its shard.
  spawn(3, [&](int rank, std::shared_ptr<Store> store) {
    torch::manual_seed(5);
    Net net;
    net->register_buffer("stat", torch::zeros({2}));
    auto model = fsdp::fully_shard(net, units_of(net), make_group(store, rank, 3));
    fsdp::load_safetensors(model, path);
    EXPECT_EQ(max_abs_diff(full_values(model.full_parameters()), saved), 0.0);
    EXPECT_TRUE(torch::equal(net->named_buffers()["stat"], stat_value()));
    // A missing file: every rank fails, none hangs.
    EXPECT_THROW(fsdp::load_safetensors(model, dir + "/absent.safetensors"), Error);
  });
}

}  // namespace
}  // namespace tdist::test

namespace tdist::test {
namespace {

// HSDP 2x2 at world 4: replica 0 alone writes (its shard group's files: 2 shards), and both a
// sharded checkpoint and a safetensors export load into plain FSDP at world 3 with the values.
TEST(FSDPCheckpoint, HsdpSavesOnceAndLoadsAtAnotherWorldWithoutReplicas) {
  const auto dir = temp_dir();
  auto batches = make_batches(2, 8, kDataSeed);
  std::vector<torch::Tensor> saved;
  spawn(4, [&](int rank, std::shared_ptr<Store> store) {
    torch::manual_seed(1);
    Net net;
    fsdp::FSDPOptions opts;
    opts.shard_size = 2;
    auto model = fsdp::fully_shard(net, units_of(net), make_group(store, rank, 4), opts);
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(kLr));
    for (const auto& b : batches) {
      opt.zero_grad();
      torch::mse_loss(model(rows_of(b.x, rank, 4)), rows_of(b.y, rank, 4)).backward();
      opt.step();
    }
    fsdp::save_sharded_checkpoint(dir + "/ckpt", model, &opt);
    fsdp::save_safetensors(model, dir + "/model.safetensors");
    auto full = full_values(model.full_parameters());
    if (rank == 0) saved = full;
  });
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/ckpt")) {
    files += e.path().filename().string().rfind("shard-", 0) == 0;
  }
  EXPECT_EQ(files, 2);
  spawn(3, [&](int rank, std::shared_ptr<Store> store) {
    auto pg = make_group(store, rank, 3);
    torch::manual_seed(6);
    Net net;
    auto model = fsdp::fully_shard(net, units_of(net), pg);
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(kLr));
    fsdp::load_sharded_checkpoint(dir + "/ckpt", model, &opt);
    EXPECT_EQ(max_abs_diff(full_values(model.full_parameters()), saved), 0.0);
    torch::manual_seed(7);
    Net other;
    auto model2 = fsdp::fully_shard(other, units_of(other), pg);
    fsdp::load_safetensors(model2, dir + "/model.safetensors");
    EXPECT_EQ(max_abs_diff(full_values(model2.full_parameters()), saved), 0.0);
  });
}

}  // namespace
}  // namespace tdist::test
