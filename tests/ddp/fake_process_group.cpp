#include "tests/ddp/fake_process_group.h"

#include <ATen/ATen.h>

#include "tdist/core/error.h"

namespace tdist::test {

FakeWorld::FakeWorld(int size) : size_(size), next_seq_(size, 0) {
  TDIST_CHECK_ARG(size >= 1, "world size must be >= 1");
  worker_ = std::thread([this] { run(); });
}

FakeWorld::~FakeWorld() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
  // Whatever is still pending never completes: fail it so that no waiter hangs.
  for (auto& [seq, slot] : pending_) {
    fail(seq, slot, std::make_exception_ptr(Error("fake world destroyed")));
  }
}

void FakeWorld::set_on_issue(std::function<void(int, const std::string&, uint64_t)> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  on_issue_ = std::move(fn);
}

std::shared_ptr<comm::Work> FakeWorld::submit(int rank, Call call) {
  auto fut = std::make_shared<comm::Future>();
  std::function<void(int, const std::string&, uint64_t)> on_issue;
  uint64_t seq;
  std::string op = call.op;
  {
    std::lock_guard<std::mutex> lock(mu_);
    seq = next_seq_[rank]++;
    if (!aborted_.empty()) {
      fut->set_error(std::make_exception_ptr(
          Error(str("rank ", rank, ": ", op, " #", seq, " after abort: ", aborted_))));
      return std::make_shared<comm::Work>(op, seq, fut);
    }
    Slot& slot = pending_[seq];
    if (slot.calls.empty()) {
      slot.calls.resize(size_);
      slot.futures.resize(size_);
      slot.deadline = std::chrono::steady_clock::now() + call.timeout;
    }
    slot.deadline = std::min(slot.deadline, std::chrono::steady_clock::now() + call.timeout);
    slot.calls[rank] = std::make_shared<Call>(std::move(call));
    slot.futures[rank] = fut;
    if (++slot.arrived == size_) ready_.push_back(seq);
    on_issue = on_issue_;
  }
  cv_.notify_all();
  if (on_issue) on_issue(rank, op, seq);
  return std::make_shared<comm::Work>(op, seq, fut);
}

void FakeWorld::abort(const std::string& why) {
  std::map<uint64_t, Slot> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.empty()) aborted_ = why;
    pending.swap(pending_);
    ready_.clear();
  }
  for (auto& [seq, slot] : pending) {
    fail(seq, slot, std::make_exception_ptr(Error(str("operation #", seq, " aborted: ", why))));
  }
}

void FakeWorld::fail(uint64_t, Slot& slot, std::exception_ptr error) {
  for (auto& f : slot.futures) {
    if (f && !f->completed()) f->set_error(error);
  }
}

void FakeWorld::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (!ready_.empty()) {
      uint64_t seq = ready_.front();
      ready_.pop_front();
      auto it = pending_.find(seq);
      if (it == pending_.end()) continue;
      Slot slot = std::move(it->second);
      pending_.erase(it);
      lock.unlock();
      execute(seq, slot);
      lock.lock();
      continue;
    }
    // Expire operations that not every rank issued in time.
    auto now = std::chrono::steady_clock::now();
    auto next = now + std::chrono::milliseconds(50);
    for (auto it = pending_.begin(); it != pending_.end();) {
      Slot& slot = it->second;
      if (slot.arrived < size_ && slot.deadline <= now) {
        std::string missing;
        for (int r = 0; r < size_; ++r) {
          if (!slot.calls[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        }
        std::string op;
        for (auto& c : slot.calls) {
          if (c) op = c->op;
        }
        auto error = std::make_exception_ptr(
            TimeoutError(str(op, " #", it->first, " timed out waiting for rank(s) ", missing)));
        Slot dead = std::move(slot);
        it = pending_.erase(it);
        lock.unlock();
        fail(0, dead, error);
        lock.lock();
        continue;
      }
      if (slot.arrived < size_) next = std::min(next, slot.deadline);
      ++it;
    }
    cv_.wait_until(lock, next);
  }
}

void FakeWorld::execute(uint64_t seq, Slot& slot) {
  try {
    const std::string& op = slot.calls[0]->op;
    for (int r = 1; r < size_; ++r) {
      TDIST_CHECK(slot.calls[r]->op == op, "operation #", seq, " mismatch: rank 0 issued ", op,
                  ", rank ", r, " issued ", slot.calls[r]->op);
    }
    if (op == "allreduce") {
      const size_t n = slot.calls[0]->inputs.size();
      for (size_t k = 0; k < n; ++k) {
        const at::Tensor& first = slot.calls[0]->inputs[k];
        const bool low = first.scalar_type() == at::kHalf || first.scalar_type() == at::kBFloat16;
        at::Tensor acc = low ? first.to(at::kFloat) : first.clone();
        for (int r = 1; r < size_; ++r) {
          const at::Tensor& t = slot.calls[r]->inputs[k];
          TDIST_CHECK(t.sizes() == first.sizes() && t.scalar_type() == first.scalar_type(),
                      "allreduce #", seq, ": rank ", r, " has ", t.sizes(), " ", t.scalar_type(),
                      ", rank 0 has ", first.sizes(), " ", first.scalar_type());
          at::Tensor v = low ? t.to(at::kFloat) : t;
          switch (slot.calls[0]->reduce_op) {
            case comm::ReduceOp::SUM:
            case comm::ReduceOp::AVG:
              acc.add_(v);
              break;
            case comm::ReduceOp::MAX:
              acc = at::maximum(acc, v);
              break;
            case comm::ReduceOp::MIN:
              acc = at::minimum(acc, v);
              break;
            case comm::ReduceOp::PRODUCT:
              acc.mul_(v);
              break;
            default:
              TDIST_THROW(InvalidArgument, "fake group: unsupported reduce op");
          }
        }
        if (slot.calls[0]->reduce_op == comm::ReduceOp::AVG) acc.div_(size_);
        for (int r = 0; r < size_; ++r) slot.calls[r]->inputs[k].copy_(acc);
      }
    } else if (op == "broadcast") {
      const int root = slot.calls[0]->root;
      const at::Tensor& src = slot.calls[root]->inputs[0];
      for (int r = 0; r < size_; ++r) {
        TDIST_CHECK(slot.calls[r]->root == root, "broadcast #", seq, ": roots differ");
        if (r != root) slot.calls[r]->inputs[0].copy_(src);
      }
    } else if (op == "allgather") {
      for (int r = 0; r < size_; ++r) {
        for (int s = 0; s < size_; ++s) slot.calls[r]->outputs[s].copy_(slot.calls[s]->inputs[0]);
      }
    } else if (op != "barrier") {
      TDIST_THROW(Error, "fake group: unknown operation ", op);
    }
  } catch (...) {
    fail(seq, slot, std::current_exception());
    return;
  }
  for (int r = 0; r < size_; ++r) {
    const auto& c = *slot.calls[r];
    slot.futures[r]->set_value(c.op == "allgather" ? c.outputs : c.inputs);
  }
}

FakeProcessGroup::FakeProcessGroup(std::shared_ptr<FakeWorld> world, int rank, Options opts)
    : world_(std::move(world)), rank_(rank), opts_(std::move(opts)) {}

std::shared_ptr<comm::Work> FakeProcessGroup::submit(comm::Call call) {
  return std::visit([this](auto& c) { return start(c); }, call);
}

std::shared_ptr<comm::Work> FakeProcessGroup::start(comm::BroadcastCall& b) {
  TDIST_CHECK_ARG(b.opts.root >= 0 && b.opts.root < size(), "broadcast root ", b.opts.root,
                  " out of range");
  FakeWorld::Call c;
  c.op = "broadcast";
  c.inputs = {b.tensor};
  c.root = b.opts.root;
  c.timeout = resolve(b.opts.timeout);
  return world_->submit(rank_, std::move(c));
}

std::shared_ptr<comm::Work> FakeProcessGroup::start(comm::AllreduceCall& a) {
  FakeWorld::Call c;
  c.op = "allreduce";
  c.inputs = {a.tensor};
  c.reduce_op = a.opts.op;
  c.timeout = resolve(a.opts.timeout);
  return world_->submit(rank_, std::move(c));
}

std::shared_ptr<comm::Work> FakeProcessGroup::start(comm::AllreduceCoalescedCall& a) {
  FakeWorld::Call c;
  c.op = "allreduce";
  c.inputs = std::move(a.tensors);
  c.reduce_op = a.opts.op;
  c.timeout = resolve(a.opts.timeout);
  return world_->submit(rank_, std::move(c));
}

std::shared_ptr<comm::Work> FakeProcessGroup::start(comm::AllgatherCall& a) {
  TDIST_CHECK_ARG(static_cast<int>(a.outputs.size()) == size(), "allgather needs ", size(),
                  " outputs, got ", a.outputs.size());
  FakeWorld::Call c;
  c.op = "allgather";
  c.inputs = {a.input};
  c.outputs = std::move(a.outputs);
  c.timeout = resolve(a.opts.timeout);
  return world_->submit(rank_, std::move(c));
}

std::shared_ptr<comm::Work> FakeProcessGroup::start(comm::BarrierCall& b) {
  FakeWorld::Call c;
  c.op = "barrier";
  c.timeout = resolve(b.opts.timeout);
  return world_->submit(rank_, std::move(c));
}

std::shared_ptr<comm::ProcessGroup> FakeProcessGroup::new_group(std::vector<int>, const Options&) {
  TDIST_THROW(InvalidArgument, "new_group is not supported in the test group");
}

void FakeProcessGroup::abort() { world_->abort(str("rank ", rank_, " aborted the group")); }

std::vector<std::shared_ptr<comm::ProcessGroup>> make_fake_groups(
    int size, comm::ProcessGroup::Options opts) {
  auto world = std::make_shared<FakeWorld>(size);
  std::vector<std::shared_ptr<comm::ProcessGroup>> groups;
  for (int r = 0; r < size; ++r)
    groups.push_back(std::make_shared<FakeProcessGroup>(world, r, opts));
  return groups;
}

}  // namespace tdist::test
