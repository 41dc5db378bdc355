// How the Reducer launches communication: comm hooks run without the Reducer's lock (so a hook
// may ask the Reducer something, or wait for another thread that does), and under
// find_unused_parameters the used-map allreduce starts together with the last bucket, before
// the end of backward waits for that bucket (as PyTorch does).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "tdist/ddp/reducer.h"
#include "tests/ddp/ddp_test_util.h"

namespace tdist::test {
namespace {

using ddp::DDPOptions;
using ddp::DistributedDataParallel;

constexpr auto kQueryWait = std::chrono::seconds(10);

// While a hook runs, another thread asks the Reducer for its buckets, and the hook waits for the
// answer (a hook that needs something another thread does under the Reducer's lock). With the
// lock held around hook calls, that thread cannot get in: the hook gives up after kQueryWait and
// the test fails instead of hanging. The hook then asks the Reducer itself, from the backward
// thread (only once the other thread got in: with the lock held this would deadlock).
TEST(DDPReducerLaunch, HookMayQueryTheReducerWhileItRuns) {
  torch::set_num_threads(1);
  run_ranks(2, [&](int rank, std::shared_ptr<comm::ProcessGroup> pg) {
    MLP net;
    DDPOptions opts;
    opts.bucket_cap_mb = 1e-6;  // one bucket per parameter: 6 buckets
    DistributedDataParallel<MLP> model(net, pg, opts);
    ddp::Reducer& reducer = model.reducer();
    std::vector<std::thread> helpers;  // joined before the model goes away
    int hooks_run = 0;
    model.register_comm_hook([&](ddp::GradBucket& bucket) {
      ++hooks_run;
      if (bucket.index() == 0 || bucket.is_last()) {
        auto answered = std::make_shared<std::atomic<bool>>(false);
        auto mu = std::make_shared<std::mutex>();
        auto cv = std::make_shared<std::condition_variable>();
        helpers.emplace_back([&reducer, answered, mu, cv] {
          size_t n = reducer.bucket_indices().size();
          {
            std::lock_guard<std::mutex> lock(*mu);
            answered->store(n == 6);
          }
          cv->notify_all();
        });
        std::unique_lock<std::mutex> lock(*mu);
        bool got = cv->wait_for(lock, kQueryWait, [&] { return answered->load(); });
        lock.unlock();
        EXPECT_TRUE(got) << "rank " << rank << ": another thread could not query the reducer "
                         << "within " << kQueryWait.count() << " s while the comm hook of bucket "
                         << bucket.index() << " ran (the hook was called under the reducer's lock)";
        if (got) {
          EXPECT_EQ(reducer.num_buckets(), 6u);  // re-entering from the hook itself
          EXPECT_EQ(reducer.bucket_indices().size(), 6u);
        }
      }
      auto& group = bucket.process_group();
      bucket.buffer().div_(group->size());
      return group->allreduce(bucket.buffer())->future();
    });
    auto x = torch::randn({4, 6});
    torch::mse_loss(model(x), torch::zeros({4, 3})).backward();
    for (auto& t : helpers) t.join();
    EXPECT_EQ(hooks_run, 6);
    EXPECT_TRUE(net->fc1->weight.grad().defined());
  });
}

// Under find_unused_parameters the used map's allreduce is issued right after the last bucket's
// collective, while that bucket is still in flight: the hook's future for the last bucket
// completes only once the group saw the next operation (the used map) issued. A Reducer that
// waits for the last bucket before it issues the used map times out here (DDP timeout 5 s).
TEST(DDPReducerLaunch, UsedMapAllreduceStartsWithTheLastBucket) {
  torch::set_num_threads(1);
  const int world = 2;
  auto w = std::make_shared<FakeWorld>(world);
  struct RankState {
    std::mutex mu;
    bool armed = false;        // the last bucket's collective was issued
    uint64_t last_seq = 0;     // its sequence number
    bool last_done = false;    // it completed
    bool next_issued = false;  // an operation after it was issued
    uint64_t next_seq = 0;
    std::string next_op;
    std::shared_ptr<comm::Future> gate;  // what the hook returned for the last bucket
    at::Tensor buffer;
    bool completed = false;
  };
  std::vector<RankState> st(world);
  // Completes the gate once the last bucket's collective finished and the next op was issued.
  auto maybe_complete = [&](int rank) {
    RankState& s = st[rank];
    std::shared_ptr<comm::Future> gate;
    at::Tensor buffer;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (s.completed || !s.last_done || !s.next_issued) return;
      s.completed = true;
      gate = s.gate;
      buffer = s.buffer;
    }
    gate->set_value({buffer});
  };
  w->set_on_issue([&](int rank, const std::string& op, uint64_t seq) {
    RankState& s = st[rank];
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (!s.armed || seq <= s.last_seq || s.next_issued) return;
      s.next_issued = true;
      s.next_seq = seq;
      s.next_op = op;
    }
    maybe_complete(rank);
  });

  std::vector<std::thread> threads;
  std::mutex err_mu;
  std::exception_ptr error;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto pg = std::make_shared<FakeProcessGroup>(w, r);
        MLP net;
        DDPOptions opts;
        opts.bucket_cap_mb = 1e-6;  // 6 buckets
        opts.find_unused_parameters = true;
        opts.timeout = std::chrono::seconds(5);
        DistributedDataParallel<MLP> model(net, pg, opts);
        model.register_comm_hook([&, r](ddp::GradBucket& bucket) {
          auto& group = bucket.process_group();
          bucket.buffer().div_(group->size());
          auto work = group->allreduce(bucket.buffer());
          if (!bucket.is_last()) return work->future();
          RankState& s = st[r];
          {
            std::lock_guard<std::mutex> lock(s.mu);
            s.armed = true;
            s.last_seq = work->sequence_number();
            s.gate = std::make_shared<comm::Future>();
            s.buffer = bucket.buffer();
          }
          work->future()->add_callback([&, r](comm::Future&) {
            {
              std::lock_guard<std::mutex> lock(st[r].mu);
              st[r].last_done = true;
            }
            maybe_complete(r);
          });
          return st[r].gate;
        });
        torch::mse_loss(model(torch::randn({4, 6})), torch::zeros({4, 3})).backward();
        EXPECT_TRUE(net->fc1->weight.grad().defined());
      } catch (...) {
        std::lock_guard<std::mutex> lock(err_mu);
        if (!error) error = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    RankState& s = st[r];
    EXPECT_TRUE(s.armed) << "rank " << r << ": the last bucket's hook never ran";
    EXPECT_TRUE(s.next_issued) << "rank " << r
                               << ": nothing was issued after the last bucket's collective (#"
                               << s.last_seq
                               << ") while it was in flight; the used map must start with it";
    if (s.next_issued) {
      EXPECT_EQ(s.next_seq, s.last_seq + 1) << "rank " << r;
      EXPECT_EQ(s.next_op, "allreduce") << "rank " << r;
    }
  }
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      FAIL() << "backward failed: " << e.what();
    }
  }
}

}  // namespace
}  // namespace tdist::test
