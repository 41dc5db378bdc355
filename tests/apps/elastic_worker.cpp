// tdist-test-elastic-worker: a small job with exact, checkpointed state for the elastic
// rendezvous tests (tests/apps/elastic_test.cpp). Every step consumes one "sample" per rank: rank
// r takes sample index samples + r and contributes sample_gradient(index); the contributions are
// allreduced (int64, exact) and folded into the parameters: params = (params * 31 + sum) mod P.
// The result depends on which samples went into which step, so it is a function of the world
// size history only, and elastic_model() computes it for the tests.
//
//   tdist-test-elastic-worker --dir DIR --samples TOTAL --schedule S0:W0,S1:W1,... [--step-ms MS]
//
// --schedule: from `samples` Si on, the job is meant to run on a world of Wi. A round whose world
// is not the one meant for the current position holds: it writes DIR/holding_<samples>_<world>
// and sleeps until its launcher stops it (a test then changes the membership). After each step
// rank 0 writes DIR/state atomically and every rank passes a barrier; a new round resumes from
// DIR/state (rank 0 reads it and broadcasts it).
// TDIST_TEST_KILL_LAUNCHER_AT=S (in one node's environment): once `samples` reached S, the worker
// SIGKILLs its launcher (the node dies; its workers die with it).
#include <ATen/ATen.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tdist/comm/process_group.h"
#include "tdist/core/env.h"
#include "tdist/core/hash.h"
#include "tests/apps/elastic_model.h"

namespace {

using tdist::test::ElasticSchedule;

struct Args {
  std::string dir;
  int64_t total = 0;
  ElasticSchedule schedule;
  int step_ms = 0;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--dir")
      a.dir = v;
    else if (k == "--samples")
      a.total = std::stoll(v);
    else if (k == "--schedule")
      a.schedule = tdist::test::parse_schedule(v);
    else if (k == "--step-ms")
      a.step_ms = std::stoi(v);
    else
      throw std::invalid_argument("unknown argument " + k);
  }
  if (a.dir.empty() || a.total <= 0 || a.schedule.empty())
    throw std::invalid_argument("need --dir, --samples and --schedule");
  return a;
}

// [samples, params...] as int64.
at::Tensor load_state(const std::string& path) {
  at::Tensor t = at::zeros({1 + tdist::test::kElasticParams}, at::kLong);
  std::ifstream in(path);
  for (int64_t i = 0; in && i < t.numel(); ++i) in >> t.data_ptr<int64_t>()[i];
  return t;
}

void save_state(const std::string& path, const at::Tensor& t) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    for (int64_t i = 0; i < t.numel(); ++i) out << t.data_ptr<int64_t>()[i] << "\n";
  }
  std::rename(tmp.c_str(), path.c_str());
}

[[noreturn]] void hold(const Args& a, int64_t samples, int world) {
  std::ofstream(a.dir + "/holding_" + std::to_string(samples) + "_" + std::to_string(world)) << "";
  std::printf("holding at %lld samples on a world of %d\n", static_cast<long long>(samples), world);
  std::fflush(stdout);
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    tdist::comm::ProcessGroup::Options opts;
    opts.timeout = std::chrono::seconds(30);
    auto pg = tdist::comm::create_process_group("env://", -1, -1, opts);
    const int rank = pg->rank(), world = pg->size();
    const int64_t kill_at = tdist::env::get_int("TDIST_TEST_KILL_LAUNCHER_AT", -1, -1, INT64_MAX);
    const std::string state_path = a.dir + "/state";

    at::Tensor state = rank == 0 ? load_state(state_path)
                                 : at::zeros({1 + tdist::test::kElasticParams}, at::kLong);
    pg->broadcast(state)->wait();
    std::printf("round start: rank %d of %d resumes at %lld samples\n", rank, world,
                static_cast<long long>(state[0].item<int64_t>()));
    std::fflush(stdout);
    for (;;) {
      const int64_t samples = state[0].item<int64_t>();
      if (kill_at >= 0 && samples >= kill_at) {
        std::printf("killing my launcher at %lld samples\n", static_cast<long long>(samples));
        std::fflush(stdout);
        ::kill(::getppid(), SIGKILL);
        for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
      }
      if (samples >= a.total) break;
      if (tdist::test::world_for(a.schedule, samples) != world) hold(a, samples, world);
      at::Tensor grad = at::empty({tdist::test::kElasticParams}, at::kLong);
      for (int64_t j = 0; j < grad.numel(); ++j)
        grad.data_ptr<int64_t>()[j] = tdist::test::sample_gradient(samples + rank, j);
      pg->allreduce(grad)->wait();
      tdist::test::apply_step(state.data_ptr<int64_t>(), grad.data_ptr<int64_t>(), world);
      if (rank == 0) save_state(state_path, state);
      pg->barrier()->wait();  // the checkpoint of this step exists before anyone goes on
      if (a.step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(a.step_ms));
    }
    pg->barrier()->wait();
    std::printf(
        "elastic worker rank %d of %d: samples %lld, params fnv1a64 %016llx\n", rank, world,
        static_cast<long long>(state[0].item<int64_t>()),
        static_cast<unsigned long long>(tdist::test::params_hash(state.data_ptr<int64_t>())));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-test-elastic-worker: %s\n", e.what());
    return 1;
  }
}
