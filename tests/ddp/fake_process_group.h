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

  std::shared_ptr<comm::Work> broadcast(at::Tensor tensor,
                                        const comm::BroadcastOptions& opts) override;
  std::shared_ptr<comm::Work> allreduce(at::Tensor tensor,
                                        const comm::AllreduceOptions& opts) override;
  std::shared_ptr<comm::Work> allreduce_coalesced(
      std::vector<at::Tensor> tensors, const comm::AllreduceCoalescedOptions& opts) override;
  std::shared_ptr<comm::Work> allgather(std::vector<at::Tensor> outputs, at::Tensor input,
                                        const comm::AllgatherOptions& opts) override;
  std::shared_ptr<comm::Work> barrier(const comm::BarrierOptions& opts) override;

  std::shared_ptr<comm::Work> reduce(at::Tensor, const comm::ReduceOptions&) override;
  std::shared_ptr<comm::Work> allgather_into_tensor(at::Tensor, at::Tensor,
                                                    const comm::AllgatherOptions&) override;
  std::shared_ptr<comm::Work> gather(std::vector<at::Tensor>, at::Tensor,
                                     const comm::GatherOptions&) override;
  std::shared_ptr<comm::Work> scatter(at::Tensor, std::vector<at::Tensor>,
                                      const comm::ScatterOptions&) override;
  std::shared_ptr<comm::Work> reduce_scatter(at::Tensor, std::vector<at::Tensor>,
                                             const comm::ReduceScatterOptions&) override;
  std::shared_ptr<comm::Work> reduce_scatter_tensor(at::Tensor, at::Tensor,
                                                    const comm::ReduceScatterOptions&) override;
  std::shared_ptr<comm::Work> alltoall_base(at::Tensor, at::Tensor, std::vector<int64_t>,
                                            std::vector<int64_t>,
                                            const comm::AllToAllOptions&) override;
  std::shared_ptr<comm::Work> alltoall(std::vector<at::Tensor>, std::vector<at::Tensor>,
                                       const comm::AllToAllOptions&) override;
  std::shared_ptr<comm::Work> send(at::Tensor, int, int, const comm::SendRecvOptions&) override;
  std::shared_ptr<comm::Work> recv(at::Tensor, int, int, const comm::SendRecvOptions&) override;
  std::shared_ptr<comm::Work> recv_any_source(at::Tensor, int,
                                              const comm::SendRecvOptions&) override;
  std::shared_ptr<comm::ProcessGroup> new_group(std::vector<int>, const Options&) override;
  void abort() override;

 private:
  Millis resolve(Millis t) const { return t.count() >= 0 ? t : opts_.timeout; }

  const std::shared_ptr<FakeWorld> world_;
  const int rank_;
  const Options opts_;
};

// One FakeProcessGroup per rank of a fresh world.
std::vector<std::shared_ptr<comm::ProcessGroup>> make_fake_groups(
    int size, comm::ProcessGroup::Options opts = {});

}  // namespace tdist::test
