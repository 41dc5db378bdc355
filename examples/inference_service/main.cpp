// A batching inference service over tdist RPC. Rank 0 ("server") holds a model; every other rank
// ("client<k>") sends it requests with rpc_async. The server groups the requests that arrive
// together (up to --max-batch of them, or whatever came within --max-wait-ms of the first) into
// one forward, then answers each caller. Clients check every answer against the same model run
// locally and print latency percentiles and throughput.
//   tdist-run --standalone --nproc-per-node 3 ./inference_service [options]
// Options: --requests N (per client), --in-flight K (per client), --max-batch B,
//          --max-wait-ms T, --die-after D (this client SIGKILLs itself once D requests are sent).
//
// RPC handlers are synchronous (a registered function returns the answer), so the handler puts
// its request on the batcher's queue and blocks on a promise that the batcher thread fulfils
// after the batch's forward. Each waiting request holds one RPC worker thread: the server gets
// enough of them for every request that can be in flight (RpcOptions::num_worker_threads).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "tdist/core/env.h"
#include "tdist/rpc/api.h"

namespace rpc = tdist::rpc;
using Clock = std::chrono::steady_clock;

struct Options {
  int requests = 200, in_flight = 8, max_batch = 16, max_wait_ms = 2, die_after = -1;
};

Options parse(int argc, char** argv) {
  Options o;
  const std::map<std::string, int*> flags = {{"--requests", &o.requests},
                                             {"--in-flight", &o.in_flight},
                                             {"--max-batch", &o.max_batch},
                                             {"--max-wait-ms", &o.max_wait_ms},
                                             {"--die-after", &o.die_after}};
  for (int i = 1; i + 1 < argc; i += 2) {
    auto it = flags.find(argv[i]);
    if (it == flags.end()) throw std::invalid_argument(std::string("unknown option ") + argv[i]);
    *it->second = std::stoi(argv[i + 1]);
  }
  if (argc % 2 == 0)
    throw std::invalid_argument(std::string("option without a value: ") + argv[argc - 1]);
  return o;
}

// The model: the same seed gives the same weights in every process.
torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::ReLU(),
                               torch::nn::Linear(64, 4));
}

// Runs one forward per batch of queued requests on its own thread.
class Batcher {
 public:
  Batcher(torch::nn::Sequential model, const Options& o)
      : model_(std::move(model)),
        max_batch_(o.max_batch),
        max_wait_(o.max_wait_ms),
        thread_([this] { loop(); }) {}
  ~Batcher() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  // Called on RPC worker threads: queues x and blocks until its batch has run.
  torch::Tensor infer(int64_t client, torch::Tensor x) {
    Request r{x, {}};
    std::future<torch::Tensor> answer = r.done.get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(&r);
      ++served_[client];
    }
    cv_.notify_all();
    return answer.get();
  }

  void report() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t total = 0;
    for (const auto& [client, n] : served_) {
      std::printf("server: served %lld requests of client%lld\n", (long long)n, (long long)client);
      total += n;
    }
    std::printf("server: served %lld requests in %lld batches (%.1f per batch)\n", (long long)total,
                (long long)batches_, batches_ ? double(total) / batches_ : 0.0);
  }

 private:
  struct Request {
    torch::Tensor x;
    std::promise<torch::Tensor> done;
  };

  void loop() {
    torch::NoGradGuard no_grad;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      // The first request waits at most max_wait_ for others to join its batch.
      const auto until = Clock::now() + max_wait_;
      cv_.wait_until(lock, until, [&] { return stop_ || int(queue_.size()) >= max_batch_; });
      const size_t n = std::min<size_t>(queue_.size(), max_batch_);
      std::vector<Request*> batch(queue_.begin(), queue_.begin() + n);
      queue_.erase(queue_.begin(), queue_.begin() + n);
      ++batches_;
      lock.unlock();
      std::vector<torch::Tensor> xs;
      for (auto* r : batch) xs.push_back(r->x);
      torch::Tensor out = model_->forward(torch::stack(xs));
      for (size_t i = 0; i < n; ++i) batch[i]->done.set_value(out[i].clone());
      lock.lock();
    }
  }

  torch::nn::Sequential model_;
  const int max_batch_;
  const std::chrono::milliseconds max_wait_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Request*> queue_;         // guarded by mu_
  std::map<int64_t, int64_t> served_;  // guarded by mu_
  int64_t batches_ = 0;                // guarded by mu_
  bool stop_ = false;                  // guarded by mu_
  std::thread thread_;
};

Batcher* g_batcher = nullptr;

// Sends o.requests requests, at most o.in_flight at a time; returns the number of wrong answers.
int run_client(int rank, const Options& o) {
  torch::nn::Sequential model = make_model();
  torch::manual_seed(rank);
  const torch::Tensor inputs = torch::randn({o.requests, 16});
  torch::Tensor expected;
  {
    torch::NoGradGuard no_grad;
    expected = model->forward(inputs);
  }
  std::vector<double> latency_ms(o.requests);
  struct InFlight {
    int index;
    rpc::Future<torch::Tensor> answer;
    rpc::Future<void> timed;  // done once the answer's latency is recorded
  };
  std::deque<InFlight> pending;
  int wrong = 0, next = 0;
  const auto start = Clock::now();
  while (next < o.requests || !pending.empty()) {
    while (next < o.requests && int(pending.size()) < o.in_flight) {
      const auto sent = Clock::now();
      auto answer = rpc::rpc_async<torch::Tensor>("server", "infer", int64_t{rank}, inputs[next]);
      // The latency is taken when the answer lands, not when this loop gets to it.
      auto timed = answer.then([&latency_ms, i = next, sent](const rpc::Future<torch::Tensor>&) {
        latency_ms[i] = std::chrono::duration<double, std::milli>(Clock::now() - sent).count();
      });
      pending.push_back({next, answer, timed});
      if (++next == o.die_after) {
        std::printf("client%d: dying with %zu requests pending\n", rank, pending.size());
        std::fflush(stdout);
        std::raise(SIGKILL);
      }
    }
    InFlight r = pending.front();
    pending.pop_front();
    r.timed.wait();
    if (!torch::allclose(r.answer.value(), expected[r.index], 1e-5, 1e-6)) ++wrong;
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::sort(latency_ms.begin(), latency_ms.end());
  auto pct = [&](double p) {
    return latency_ms[std::min<size_t>(latency_ms.size() - 1, p * latency_ms.size())];
  };
  std::printf(
      "client%d: %d answers, %d differ from local inference; latency p50 %.2f ms, p90 %.2f ms, "
      "p99 %.2f ms; %.0f requests/s\n",
      rank, o.requests, wrong, pct(0.5), pct(0.9), pct(0.99), o.requests / seconds);
  return wrong;
}

int main(int argc, char** argv) {
  try {
    torch::set_num_threads(1);
    const Options o = parse(argc, argv);
    const auto env = tdist::env::read_dist_env();  // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rpc::RpcOptions ro;
    std::unique_ptr<Batcher> batcher;
    if (env.rank == 0) {
      batcher = std::make_unique<Batcher>(make_model(), o);
      g_batcher = batcher.get();
      rpc::register_function(
          "infer", [](int64_t client, torch::Tensor x) { return g_batcher->infer(client, x); });
      // One thread per request that can wait in the batcher, plus a few for the RPC layer.
      ro.num_worker_threads = (env.world_size - 1) * o.in_flight + 4;
    }
    rpc::init_rpc(env.rank == 0 ? "server" : "client" + std::to_string(env.rank), env.rank,
                  env.world_size, ro);
    const int wrong = env.rank == 0 ? 0 : run_client(env.rank, o);
    rpc::shutdown();  // the server serves until every client is done (or gone)
    if (batcher) batcher->report();
    return wrong == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "inference_service: %s\n", e.what());
    return 1;
  }
}
