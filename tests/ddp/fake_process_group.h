#pragma once
// A test-only ProcessGroup for ranks that are threads of one process: the ranks of a FakeWorld
// meet through shared memory. allreduce, allreduce_coalesced, broadcast, allgather and barrier
// are implemented (asynchronously: a world thread completes each operation once every rank
// issued it); every other operation throws "not supported in the test group".
//
// Operations are matched by each rank's issue order (as on the wire): the k-th operation of
// every rank must be the same kind, else all of them fail. An operation that not every rank
// issued within its timeout fails with TimeoutError naming the ranks that are missing.
// It also records the order of issued operations (issued_log) for ordering tests.
//
// Thread safe. The world outlives its groups (they hold it by shared_ptr).

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"

namespace tdist::test {

class FakeWorld {
 public:
  explicit FakeWorld(int size);
  ~FakeWorld();

  int size() const { return size_; }

  struct Call {
    std::string op;
    std::vector<at::Tensor> inputs;   // allreduce: the tensors (in-place); allgather: {input}
    std::vector<at::Tensor> outputs;  // allgather: the per-rank outputs
    comm::ReduceOp reduce_op = comm::ReduceOp::SUM;
    int root = 0;
    Millis timeout{30000};
  };
  std::shared_ptr<comm::Work> submit(int rank, Call call);
  void abort(const std::string& why);

  // Hooks for tests: called on the issuing thread right after rank's op was queued.
  void set_on_issue(std::function<void(int rank, const std::string& op, uint64_t seq)> fn);

 private:
  struct Slot {
    std::vector<std::shared_ptr<Call>> calls;  // per rank, null until that rank issued
    std::vector<std::shared_ptr<comm::Future>> futures;
    int arrived = 0;
    std::chrono::steady_clock::time_point deadline;
  };
  void run();
  void execute(uint64_t seq, Slot& slot);
  void fail(uint64_t seq, Slot& slot, std::exception_ptr error);

  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint64_t> next_seq_;                                   // guarded by mu_, per rank
  std::map<uint64_t, Slot> pending_;                                 // guarded by mu_
  std::deque<uint64_t> ready_;                                       // guarded by mu_
  bool stop_ = false;                                                // guarded by mu_
  std::string aborted_;                                              // guarded by mu_
  std::function<void(int, const std::string&, uint64_t)> on_issue_;  // guarded by mu_
  std::thread worker_;
};

class FakeProcessGroup : public comm::ProcessGroup {
 public:
  FakeProcessGroup(std::shared_ptr<FakeWorld> world, int rank, Options opts = {});

  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }
  std::string backend_name() const override { return "fake"; }
  const Options& options() const override { return opts_; }

  // broadcast, allreduce (and allreduce_coalesced), allgather and barrier; any other operation
  // throws InvalidArgument.
  std::shared_ptr<comm::Work> submit(comm::Call call) override;
  std::shared_ptr<comm::ProcessGroup> new_group(std::vector<int>, const Options&) override;
  void abort() override;

 private:
  Millis resolve(Millis t) const { return t.count() >= 0 ? t : opts_.timeout; }
  std::shared_ptr<comm::Work> start(comm::BroadcastCall& c);
  std::shared_ptr<comm::Work> start(comm::AllreduceCall& c);
  std::shared_ptr<comm::Work> start(comm::AllreduceCoalescedCall& c);
  std::shared_ptr<comm::Work> start(comm::AllgatherCall& c);
  std::shared_ptr<comm::Work> start(comm::BarrierCall& c);
  // The operations the test group does not model.
  template <class Other>
  std::shared_ptr<comm::Work> start(Other&) {
    TDIST_THROW(InvalidArgument, Other::kName, " is not supported in the test group");
  }

  const std::shared_ptr<FakeWorld> world_;
  const int rank_;
  const Options opts_;
};

// One FakeProcessGroup per rank of a fresh world.
std::vector<std::shared_ptr<comm::ProcessGroup>> make_fake_groups(
    int size, comm::ProcessGroup::Options opts = {});

}  // namespace tdist::test
