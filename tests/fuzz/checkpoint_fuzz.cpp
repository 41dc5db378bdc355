// Fuzzes tdist-train's checkpoint reader (apps/train/checkpoint.h) as --resume uses it: the
// input, after its first byte, is written as <dir>/checkpoint.pt, read back with
// read_checkpoint_file and loaded with load_checkpoint into a small model and its optimizer (bit
// 0 of the first byte: Adam, else SGD with momentum), under the fingerprint the seeds were
// written with. Any input must load or be refused with the reader's own errors (Error, or
// InvalidArgument for another run's fingerprint), never a crash, a sanitizer report in tdist's
// code or an allocation the file does not pay for. libtorch's archive reader, which parses what
// follows the header, is not instrumented: its crashes show, its sanitizer reports do not.
//
// TDIST_FUZZ_WRITE_SEEDS=<dir> fuzz_checkpoint writes the seed corpus (checkpoints that
// save_checkpoint writes for that model, behind the first byte) into <dir> and exits.
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "apps/train/checkpoint.h"
#include "tdist/core/error.h"
#include "tests/fuzz/fuzz_files.h"

namespace {

namespace train = tdist::train;

constexpr const char* kFingerprint = "fuzz model=linear-3-2";

std::string g_dir;

struct Run {
  torch::nn::Sequential model{torch::nn::Linear(3, 2)};
  std::unique_ptr<torch::optim::Optimizer> optimizer;

  explicit Run(bool adam) {
    if (adam) {
      optimizer =
          std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(0.1));
    } else {
      optimizer = std::make_unique<torch::optim::SGD>(model->parameters(),
                                                      torch::optim::SGDOptions(0.1).momentum(0.9));
    }
  }
};

// Checkpoints of each optimizer, before any step (no optimizer state) and after one.
void write_seeds(const std::string& out) {
  for (bool adam : {false, true}) {
    for (int steps : {0, 1}) {
      torch::manual_seed(1);
      Run run(adam);
      for (int i = 0; i < steps; ++i) {
        run.optimizer->zero_grad();
        run.model->forward(torch::ones({4, 3})).sum().backward();
        run.optimizer->step();
      }
      train::TrainState state;
      state.step = steps;
      state.world_size = 2;
      if (steps) state.rng_state = torch::ones({4}, torch::kByte);
      train::save_checkpoint(g_dir, *run.model, *run.optimizer, state, kFingerprint);
      auto bytes = train::read_checkpoint_file(g_dir);
      const std::string name = std::string(adam ? "adam" : "sgd") + "_step" + std::to_string(steps);
      tdist::fuzz::write_seed(out + "/" + name, adam ? 1 : 0, *bytes);
    }
  }
}

}  // namespace

// libtorch's archive reader leaks on some archives it refuses (miniz's state, when its zip reader
// throws). Only an archive whose digest matches reaches it, which the fuzzer can forge (it sees
// the digest compared); those leaks are libtorch's, not the reader's.
extern "C" const char* __lsan_default_suppressions() { return "leak:libtorch_cpu.so\n"; }

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_dir = tdist::fuzz::make_temp_dir("checkpoint");
  std::atexit([] {
    ::unlink(train::checkpoint_path(g_dir).c_str());
    ::rmdir(g_dir.c_str());
  });
  tdist::fuzz::write_seeds_if_asked(write_seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool adam = data[0] & 1;
  FILE* f = std::fopen(train::checkpoint_path(g_dir).c_str(), "wb");
  if (!f || std::fwrite(data + 1, 1, size - 1, f) != size - 1 || std::fclose(f) != 0) std::abort();
  Run run(adam);
  try {
    const auto bytes = train::read_checkpoint_file(g_dir);
    if (!bytes) std::abort();
    (void)train::load_checkpoint(*bytes, *run.model, *run.optimizer, kFingerprint);
  } catch (const tdist::Error&) {}
  return 0;
}
