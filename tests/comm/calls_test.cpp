// Note [One operation table] (comm/calls.h): every ProcessGroup method submits its own Call with
// the arguments it was given, for_each_tensor sees every tensor of it, and the dispatch routes
// each one, with no code per operation, to the backend of its tensors' device (host tensors
// here; CUDA ones, and an operation mixing the two, in cuda_test.cpp's DeviceDispatch cases).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "tdist/comm/device_dispatch.h"
#include "tdist/comm/process_group.h"

namespace tdist::comm {
namespace {

// Keeps every Call it is given and answers with a completed Work.
class RecordingGroup : public ProcessGroup {
 public:
  explicit RecordingGroup(std::string name) : name_(std::move(name)) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string backend_name() const override { return name_; }
  const Options& options() const override { return opts_; }
  std::shared_ptr<Work> submit(Call call) override {
    calls.push_back(std::move(call));
    auto future = std::make_shared<Future>();
    future->set_value({});
    return std::make_shared<Work>(call_name(calls.back()), calls.size(), future);
  }
  std::shared_ptr<ProcessGroup> new_group(std::vector<int>, const Options&) override {
    return nullptr;
  }
  void abort() override {}

  std::vector<Call> calls;

 private:
  const std::string name_;
  Options opts_;
};

int tensor_count(const Call& call) {
  int n = 0;
  for_each_tensor(call, [&](const at::Tensor&) { ++n; });
  return n;
}

// Issues every operation once, each with tensors of its own shape and options of their own.
void issue_every_operation(ProcessGroup& pg) {
  auto t = [](int64_t n) { return torch::zeros({n}); };
  pg.broadcast(t(1), BroadcastOptions{1});
  pg.allreduce(t(2), AllreduceOptions{ReduceOp::MAX});
  pg.allreduce_coalesced({t(3), t(3)});
  pg.reduce(t(4), ReduceOptions{ReduceOp::MIN, 1});
  pg.allgather({t(5), t(5)}, t(5));
  pg.allgather_into_tensor(t(12), t(6));
  pg.gather({t(7), t(7)}, t(7), GatherOptions{1});
  pg.scatter(t(8), {t(8), t(8)}, ScatterOptions{1});
  pg.reduce_scatter(t(9), {t(9), t(9)});
  pg.reduce_scatter_tensor(t(10), t(20));
  pg.alltoall_base(t(11), t(11), {5, 6}, {6, 5});
  pg.alltoall({t(12), t(12)}, {t(12), t(12)});
  pg.barrier();
  pg.send(t(13), 1, 7);
  pg.recv(t(14), 1, 8);
  pg.recv_any_source(t(15), 9);
}

TEST(OperationTable, EveryMethodSubmitsItsOwnCallWithItsArguments) {
  RecordingGroup pg("recording");
  issue_every_operation(pg);
  const std::vector<std::string> names{"broadcast",
                                       "allreduce",
                                       "allreduce_coalesced",
                                       "reduce",
                                       "allgather",
                                       "allgather_into_tensor",
                                       "gather",
                                       "scatter",
                                       "reduce_scatter",
                                       "reduce_scatter_tensor",
                                       "alltoall_base",
                                       "alltoall",
                                       "barrier",
                                       "send",
                                       "recv",
                                       "recv_any_source"};
  const std::vector<int> tensors{1, 1, 2, 1, 3, 2, 3, 3, 3, 2, 2, 4, 0, 1, 1, 1};
  ASSERT_EQ(pg.calls.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(call_name(pg.calls[i]), names[i]);
    EXPECT_EQ(tensor_count(pg.calls[i]), tensors[i]) << names[i];
  }
  // The arguments arrive as given.
  EXPECT_EQ(std::get<BroadcastCall>(pg.calls[0]).opts.root, 1);
  EXPECT_EQ(std::get<AllreduceCall>(pg.calls[1]).opts.op, ReduceOp::MAX);
  const auto& reduce = std::get<ReduceCall>(pg.calls[3]);
  EXPECT_EQ(reduce.opts.op, ReduceOp::MIN);
  EXPECT_EQ(reduce.opts.root, 1);
  EXPECT_EQ(reduce.tensor.numel(), 4);
  const auto& into = std::get<AllgatherIntoTensorCall>(pg.calls[5]);
  EXPECT_EQ(into.output.numel(), 12);
  EXPECT_EQ(into.input.numel(), 6);
  const auto& rst = std::get<ReduceScatterTensorCall>(pg.calls[9]);
  EXPECT_EQ(rst.output.numel(), 10);
  EXPECT_EQ(rst.input.numel(), 20);
  const auto& a2a = std::get<AlltoallBaseCall>(pg.calls[10]);
  EXPECT_EQ(a2a.output_splits, (std::vector<int64_t>{5, 6}));
  EXPECT_EQ(a2a.input_splits, (std::vector<int64_t>{6, 5}));
  const auto& send = std::get<SendCall>(pg.calls[13]);
  EXPECT_EQ(send.dst, 1);
  EXPECT_EQ(send.tag, 7);
  const auto& recv = std::get<RecvCall>(pg.calls[14]);
  EXPECT_EQ(recv.src, 1);
  EXPECT_EQ(recv.tag, 8);
  EXPECT_EQ(std::get<RecvAnySourceCall>(pg.calls[15]).tag, 9);
}

TEST(OperationTable, TheDispatchSendsEveryHostOperationToTheCpuBackend) {
  auto cpu = std::make_shared<RecordingGroup>("cpu-side");
  auto cuda = std::make_shared<RecordingGroup>("cuda-side");
  detail::DispatchProcessGroup pg(cpu, cuda, ProcessGroup::Options{});
  issue_every_operation(pg);
  EXPECT_EQ(cpu->calls.size(), 16u);
  EXPECT_TRUE(cuda->calls.empty());
  for (size_t i = 0; i < cpu->calls.size(); ++i) {
    EXPECT_EQ(cpu->calls[i].index(), i) << call_name(cpu->calls[i]);
  }
}

}  // namespace
}  // namespace tdist::comm
