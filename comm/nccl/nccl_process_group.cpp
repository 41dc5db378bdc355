#include "tdist/comm/nccl/nccl_process_group.h"

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <algorithm>

#include "tdist/comm/nccl/c10d_store.h"
#include "tdist/comm/nccl/entry_point.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/prefix_store.h"

namespace tdist::comm::nccl {
namespace {

::c10d::ReduceOp c10d_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
      return ::c10d::ReduceOp::SUM;
    case ReduceOp::AVG:
      return ::c10d::ReduceOp::AVG;
    case ReduceOp::PRODUCT:
      return ::c10d::ReduceOp::PRODUCT;
    case ReduceOp::MIN:
      return ::c10d::ReduceOp::MIN;
    case ReduceOp::MAX:
      return ::c10d::ReduceOp::MAX;
    case ReduceOp::BAND:
      return ::c10d::ReduceOp::BAND;
    case ReduceOp::BOR:
      return ::c10d::ReduceOp::BOR;
    case ReduceOp::BXOR:
      return ::c10d::ReduceOp::BXOR;
  }
  TDIST_THROW(InvalidArgument, "unknown reduce op ", static_cast<int>(op));
}

// The error of an operation (Note [NCCL works]): names the rank, the operation and its number.
Error op_error(int rank, const std::string& op, uint64_t seq, const std::string& what) {
  return Error(str("rank ", rank, ": ", op, " (seq ", seq, ") through NCCL: ", what));
}

void check_cuda(const at::Tensor& t, const char* op, const char* what) {
  TDIST_CHECK_ARG(t.defined(), op, ": ", what, " is undefined");
  TDIST_CHECK_ARG(t.is_cuda(), op, ": ", what, " is a ", t.device().str(),
                  " tensor; the nccl backend serves CUDA tensors");
}

// Note [Split communicators]: the member colour of a split (one subgroup per ncclCommSplit).
constexpr int kMemberColor = 0;

at::Device bound_device(int id) { return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(id)); }

}  // namespace

struct NcclProcessGroup::SplitFrom {
  c10::intrusive_ptr<::c10d::ProcessGroupNCCL> parent;
  std::vector<uint64_t> ranks;  // the subgroup's ranks in the parent
};

NcclProcessGroup::NcclProcessGroup(std::shared_ptr<Store> store, std::string prefix, int rank,
                                   int size, const Options& opts)
    : NcclProcessGroup(std::move(store), std::move(prefix), rank, size, opts, nullptr) {}

NcclProcessGroup::NcclProcessGroup(std::shared_ptr<Store> store, std::string prefix, int rank,
                                   int size, const Options& opts, const SplitFrom* split)
    : store_(std::move(store)), prefix_(std::move(prefix)), rank_(rank), size_(size), opts_(opts) {
  auto c10d_opts = ::c10d::ProcessGroupNCCL::Options::create();
  c10d_opts->timeout = opts_.timeout;
  if (split != nullptr) {
    c10d_opts->split_from = split->parent;
    c10d_opts->split_color = kMemberColor;
    c10d_opts->global_ranks_in_group = split->ranks;
  }
  if (opts_.device_id) {
    const int devices = static_cast<int>(c10::cuda::device_count());
    TDIST_CHECK_ARG(*opts_.device_id >= 0 && *opts_.device_id < devices, "rank ", rank_,
                    ": device_id ", *opts_.device_id, " is not a visible GPU (", devices,
                    " visible)");
  }
  auto scoped = std::make_shared<PrefixStore>(prefix_ + "/", store_);
  pg_ = c10::make_intrusive<::c10d::ProcessGroupNCCL>(
      c10::make_intrusive<C10dStore>(scoped, opts_.timeout), rank_, size_, c10d_opts);
  if (opts_.device_id) {
    // Collective over the group's ranks; for a split, over the parent's (Note [Split
    // communicators]).
    pg_->setBoundDeviceId(bound_device(*opts_.device_id));
    pg_->eagerConnectSingleDevice(bound_device(*opts_.device_id));
  }
  completer_ = std::thread([this] { complete_loop(); });
}

uint64_t NcclProcessGroup::comm_split_count() const { return pg_->getCommSplitCounter(); }

NcclProcessGroup::~NcclProcessGroup() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  completer_.join();
  try {
    pg_->shutdown();
  } catch (const std::exception& e) {
    TDIST_LOG_WARN("rank ", rank_, ": shutting the NCCL group down: ", e.what());
  }
}

std::chrono::milliseconds NcclProcessGroup::timeout_of(Millis t) const {
  return t.count() < 0 ? opts_.timeout : t;
}

namespace {

// Note [NCCL works]: wait() is c10d's stream wait; synchronize() and future() see the device
// finish (the group's completion thread).
class NcclWork : public Work {
 public:
  NcclWork(std::string op, uint64_t seq, std::shared_ptr<Future> future,
           c10::intrusive_ptr<::c10d::Work> work, int rank)
      : Work(std::move(op), seq, std::move(future)), work_(std::move(work)), rank_(rank) {}

  bool wait(Millis timeout) override {
    try {
      work_->wait(timeout.count() < 0 ? std::chrono::milliseconds(0) : timeout);
    } catch (const std::exception& e) {
      throw op_error(rank_, op(), sequence_number(), str("failed: ", e.what()));
    }
    return true;
  }
  void synchronize() override { future_unobserved()->wait(); }

 private:
  const c10::intrusive_ptr<::c10d::Work> work_;
  const int rank_;
};

}  // namespace

std::shared_ptr<Work> NcclProcessGroup::issue(
    const std::string& op, std::vector<at::Tensor> outputs,
    const std::function<c10::intrusive_ptr<::c10d::Work>()>& call) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    seq = next_seq_++;
  }
  auto future = std::make_shared<Future>();
  c10::intrusive_ptr<::c10d::Work> work;
  try {
    work = call();
  } catch (const tdist::Error&) {
    throw;
  } catch (const std::exception& e) {
    throw op_error(rank_, op, seq, str("failed: ", e.what()));
  }
  auto ours = std::make_shared<NcclWork>(op, seq, future, work, rank_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(Pending{op, seq, work, std::move(outputs), future});
  }
  cv_.notify_all();
  return ours;
}

void NcclProcessGroup::complete_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
    if (stopping_) break;
    // Operations finish in the order they were issued on the NCCL stream: look at the oldest.
    // Unlocked while c10d is asked; abort() may fail and remove it meanwhile.
    const uint64_t seq = pending_.front().seq;
    const auto work = pending_.front().work;
    bool done = false;
    std::exception_ptr error;
    lock.unlock();
    try {
      done = work->isCompleted();
      if (done) error = work->exception();
    } catch (...) {
      done = true;
      error = std::current_exception();
    }
    lock.lock();
    if (pending_.empty() || pending_.front().seq != seq) continue;
    if (!done) {
      cv_.wait_for(lock, std::chrono::microseconds(50));
      continue;
    }
    Pending finished = std::move(pending_.front());
    pending_.pop_front();
    lock.unlock();
    if (error) {
      finished.future->set_error(std::make_exception_ptr(
          op_error(rank_, finished.op, finished.seq, "failed: " + exception_message(error))));
    } else {
      finished.future->set_value(std::move(finished.outputs));
    }
    lock.lock();
  }
  // Destroyed with operations pending: they fail rather than leave their waiters hanging.
  while (!pending_.empty()) {
    Pending p = std::move(pending_.front());
    pending_.pop_front();
    p.future->set_error(std::make_exception_ptr(
        op_error(rank_, p.op, p.seq, "the group was destroyed before the operation finished")));
  }
}

template <>
std::shared_ptr<Work> NcclProcessGroup::start(BroadcastCall& c) {
  auto& tensor = c.tensor;
  const auto& opts = c.opts;
  check_cuda(tensor, "broadcast", "the tensor");
  TDIST_CHECK_ARG(opts.root >= 0 && opts.root < size_, "broadcast: root ", opts.root,
                  " is not in [0, ", size_, ")");
  return issue("broadcast", {tensor}, [&] {
    std::vector<at::Tensor> ts{tensor};
    ::c10d::BroadcastOptions o;
    o.rootRank = opts.root;
    o.timeout = timeout_of(opts.timeout);
    return pg_->broadcast(ts, o);
  });
}

template <>
std::shared_ptr<Work> NcclProcessGroup::start(AllreduceCall& c) {
  auto& tensor = c.tensor;
  const auto& opts = c.opts;
  check_cuda(tensor, "allreduce", "the tensor");
  return issue("allreduce", {tensor}, [&] {
    std::vector<at::Tensor> ts{tensor};
    ::c10d::AllreduceOptions o;
    o.reduceOp = c10d_op(opts.op);
    o.timeout = timeout_of(opts.timeout);
    return pg_->allreduce(ts, o);
  });
}

template <>
std::shared_ptr<Work> NcclProcessGroup::start(AllreduceCoalescedCall& c) {
  auto& tensors = c.tensors;
  const auto& opts = c.opts;
  TDIST_CHECK_ARG(!tensors.empty(), "allreduce_coalesced: no tensors given");
  for (const auto& t : tensors) check_cuda(t, "allreduce_coalesced", "a tensor");
  return issue("allreduce_coalesced", tensors, [&] {
    ::c10d::AllreduceCoalescedOptions o;
    o.reduceOp = c10d_op(opts.op);
    o.timeout = timeout_of(opts.timeout);
    return pg_->allreduce_coalesced(tensors, o);
  });
}

template <>
std::shared_ptr<Work> NcclProcessGroup::start(ReduceCall& c) {
  auto& tensor = c.tensor;
  const auto& opts = c.opts;
  check_cuda(tensor, "reduce", "the tensor");
  TDIST_CHECK_ARG(opts.root >= 0 && opts.root < size_, "reduce: root ", opts.root,
                  " is not in [0, ", size_, ")");
  return issue("reduce", {tensor}, [&] {
    std::vector<at::Tensor> ts{tensor};
    ::c10d::ReduceOptions o;
    o.reduceOp = c10d_op(opts.op);
    o.rootRank = opts.root;
    o.timeout = timeout_of(opts.timeout);
    return pg_->reduce(ts, o);
  });
}

template <>
std::shared_ptr<Work> NcclProcessGroup::start(AllgatherCall& c) {
  auto& outputs = c.outputs;
  auto& input = c.input;
  const auto& opts = c.opts;
  check_cuda(input, "allgather", "the input");
  for (const auto& t : outputs) check_cuda(t, "allgather", "an output");
  return issue("allgather", outputs, [&] {
    std::vector<std::vector<at::Tensor>> outs{outputs};
    std::vector<at::Tensor> ins{input};
    ::c10d::AllgatherOptions o;
    o.timeout = timeout_of(opts.timeout);
    return pg_->allgather(outs, ins, o);
  });
}

template <>
std::shared_ptr<Work> NcclProcessGroup::start(AllgatherIntoTensorCall& c) {
  auto& output = c.output;
  auto& input = c.input;
  const auto& opts = c.opts;
  check_cuda(input, "allgather_into_tensor", "the input");
  check_cuda(output, "allgather_into_tensor", "the output");
  return issue("allgather_into_tensor", {output}, [&] {
    ::c10d::AllgatherOptions o;
    o.timeout = timeout_of(opts.timeout);
    return pg_->_allgather_base(output, input, o);
  });
}

template <>
std::shared_ptr<Work> NcclProcessGroup::start(GatherCall& c) {
  auto& outputs = c.outputs;
  auto& input = c.input;
  const auto& opts = c.opts;
  check_cuda(input, "gather", "the input");
  for (const auto& t : outputs) check_cuda(t, "gather", "an output");
  return issue("gather", outputs, [&] {
    std::vector<std::vector<at::Tensor>> outs;
    if (rank_ == opts.root) outs.push_back(outputs);
    std::vector<at::Tensor> ins{input};
    ::c10d::GatherOptions o;
    o.rootRank = opts.root;
    o.timeout = timeout_of(opts.timeout);
    return pg_->gather(outs, ins, o);
  });
}

template <>
std::shared_ptr<Work> NcclProcessGroup::start(ScatterCall& c) {
  auto& output = c.output;
  auto& inputs = c.inputs;
  const auto& opts = c.opts;
  check_cuda(output, "scatter", "the output");
  for (const auto& t : inputs) check_cuda(t, "scatter", "an input");
  return issue("scatter", {output}, [&] {
    std::vector<at::Tensor> outs{output};
    std::vector<std::vector<at::Tensor>> ins;
    if (rank_ == opts.root) ins.push_back(inputs);
    ::c10d::ScatterOptions o;
    o.rootRank = opts.root;
    o.timeout = timeout_of(opts.timeout);
    return pg_->scatter(outs, ins, o);
  });
}

template <>
std::shared_ptr<Work> NcclProcessGroup::start(ReduceScatterCall& c) {
  auto& output = c.output;
  auto& inputs = c.inputs;
  const auto& opts = c.opts;
  check_cuda(output, "reduce_scatter", "the output");
  for (const auto& t : inputs) check_cuda(t, "reduce_scatter", "an input");
  return issue("reduce_scatter", {output}, [&] {
    std::vector<at::Tensor> outs{output};
    std::vector<std::vector<at::Tensor>> ins{inputs};
    ::c10d::ReduceScatterOptions o;
    o.reduceOp = c10d_op(opts.op);
    o.timeout = timeout_of(opts.timeout);
    return pg_->reduce_scatter(outs, ins, o);
  });
}

template <>
std::shared_ptr<Work> NcclProcessGroup::start(ReduceScatterTensorCall& c) {
  auto& output = c.output;
  auto& input = c.input;
  const auto& opts = c.opts;
  check_cuda(output, "reduce_scatter_tensor", "the output");
  check_cuda(input, "reduce_scatter_tensor", "the input");
  return issue("reduce_scatter_tensor", {output}, [&] {
    ::c10d::ReduceScatterOptions o;
    o.reduceOp = c10d_op(opts.op);
    o.timeout = timeout_of(opts.timeout);
    return pg_->_reduce_scatter_base(output, input, o);
  });
}

template <>
std::shared_ptr<Work> NcclProcessGroup::start(AlltoallBaseCall& c) {
  auto& output = c.output;
  auto& input = c.input;
  auto& output_splits = c.output_splits;
  auto& input_splits = c.input_splits;
  const auto& opts = c.opts;
  check_cuda(output, "alltoall_base", "the output");
  check_cuda(input, "alltoall_base", "the input");
  return issue("alltoall_base", {output}, [&] {
    ::c10d::AllToAllOptions o;
    o.timeout = timeout_of(opts.timeout);
    return pg_->alltoall_base(output, input, output_splits, input_splits, o);
  });
}

template <>
std::shared_ptr<Work> NcclProcessGroup::start(AlltoallCall& c) {
  auto& outputs = c.outputs;
  auto& inputs = c.inputs;
  const auto& opts = c.opts;
  for (const auto& t : outputs) check_cuda(t, "alltoall", "an output");
  for (const auto& t : inputs) check_cuda(t, "alltoall", "an input");
  return issue("alltoall", outputs, [&] {
    ::c10d::AllToAllOptions o;
    o.timeout = timeout_of(opts.timeout);
    return pg_->alltoall(outputs, inputs, o);
  });
}

template <>
std::shared_ptr<Work> NcclProcessGroup::start(BarrierCall& c) {
  const auto& opts = c.opts;
  return issue("barrier", {}, [&] {
    ::c10d::BarrierOptions o;
    o.timeout = timeout_of(opts.timeout);
    return pg_->barrier(o);
  });
}

template <>
std::shared_ptr<Work> NcclProcessGroup::start(SendCall& c) {
  auto& tensor = c.tensor;
  const int dst = c.dst;
  const int tag = c.tag;
  check_cuda(tensor, "send", "the tensor");
  TDIST_CHECK_ARG(dst >= 0 && dst < size_ && dst != rank_, "send: peer rank ", dst,
                  " is not another rank of [0, ", size_, ")");
  return issue("send", {tensor}, [&] {
    std::vector<at::Tensor> ts{tensor};
    return pg_->send(ts, dst, tag);
  });
}

template <>
std::shared_ptr<Work> NcclProcessGroup::start(RecvCall& c) {
  auto& tensor = c.tensor;
  const int src = c.src;
  const int tag = c.tag;
  check_cuda(tensor, "recv", "the tensor");
  TDIST_CHECK_ARG(src >= 0 && src < size_ && src != rank_, "recv: peer rank ", src,
                  " is not another rank of [0, ", size_, ")");
  return issue("recv", {tensor}, [&] {
    std::vector<at::Tensor> ts{tensor};
    return pg_->recv(ts, src, tag);
  });
}

template <>
std::shared_ptr<Work> NcclProcessGroup::start(RecvAnySourceCall&) {
  TDIST_THROW(InvalidArgument,
              "recv_any_source: NCCL cannot receive from any source; name the "
              "source rank, or use a CPU tensor (the ring backend serves it)");
}

// After every start(): each Call's (Note [One operation table]).
std::shared_ptr<Work> NcclProcessGroup::submit(Call call) {
  return std::visit([this](auto& c) { return start(c); }, call);
}

std::shared_ptr<ProcessGroup> NcclProcessGroup::new_group(std::vector<int> ranks,
                                                          const Options& opts) {
  std::sort(ranks.begin(), ranks.end());
  TDIST_CHECK_ARG(!ranks.empty() && std::adjacent_find(ranks.begin(), ranks.end()) == ranks.end() &&
                      ranks.front() >= 0 && ranks.back() < size_,
                  "new_group: ranks must be distinct ranks of [0, ", size_, ")");
  uint64_t n;
  {
    std::lock_guard<std::mutex> lock(mu_);
    n = subgroups_++;  // every rank calls new_group in the same order: the same n everywhere
  }
  auto me = std::find(ranks.begin(), ranks.end(), rank_);
  // Note [Split communicators]: the same decision on every rank.
  const bool split = opts_.device_id && opts.device_id == opts_.device_id;
  if (me == ranks.end()) {
    if (split) pg_->performNocolorSplit(bound_device(*opts_.device_id));
    return nullptr;
  }
  const int rank = static_cast<int>(me - ranks.begin());
  const int size = static_cast<int>(ranks.size());
  if (!split) {
    return std::make_shared<NcclProcessGroup>(store_, str(prefix_, "/sub", n), rank, size, opts);
  }
  SplitFrom from{pg_, std::vector<uint64_t>(ranks.begin(), ranks.end())};
  return std::shared_ptr<NcclProcessGroup>(
      new NcclProcessGroup(store_, str(prefix_, "/sub", n), rank, size, opts, &from));
}

void NcclProcessGroup::abort() {
  pg_->abort();
  std::deque<Pending> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed.swap(pending_);
  }
  for (auto& p : failed) {
    p.future->set_error(
        std::make_exception_ptr(op_error(rank_, p.op, p.seq, "the group was aborted")));
  }
}

}  // namespace tdist::comm::nccl

// The entry point create_process_group looks up after loading this library (dlsym).
extern "C" __attribute__((visibility("default"))) tdist::comm::nccl::BackendFactory
tdist_comm_nccl_factory() {
  return [](std::shared_ptr<tdist::Store> store, std::string prefix, int rank, int size,
            const tdist::comm::ProcessGroup::Options& opts)
             -> std::shared_ptr<tdist::comm::ProcessGroup> {
    return std::make_shared<tdist::comm::nccl::NcclProcessGroup>(
        std::move(store), std::move(prefix), rank, size, opts);
  };
}
