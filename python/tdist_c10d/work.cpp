#include "tdist/python/tdist_c10d/work.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <string>

#include "tdist/core/error.h"

namespace tdist::c10d_backend {
namespace {

constexpr std::chrono::milliseconds kC10dNoTimeout{0};

// Completes when every one of `works` has; fails with the first error seen.
std::shared_ptr<comm::Future> join(const std::vector<std::shared_ptr<comm::Work>>& works) {
  if (works.size() == 1) return works[0]->future_unobserved();
  if (works.empty()) return comm::Future::completed({});
  struct State {
    std::mutex mu;
    size_t remaining;
    std::exception_ptr first_error;  // guarded by mu
  };
  auto joint = std::make_shared<comm::Future>();
  auto state = std::make_shared<State>();
  state->remaining = works.size();
  for (const auto& w : works) {
    w->future_unobserved()->add_callback([joint, state](comm::Future& f) {
      std::exception_ptr error;
      {
        std::lock_guard<std::mutex> lock(state->mu);
        if (f.has_error() && !state->first_error) state->first_error = f.error();
        if (--state->remaining > 0) return;
        error = state->first_error;
      }
      if (error) {
        joint->set_error(error);
      } else {
        joint->set_value({});
      }
    });
  }
  return joint;
}

}  // namespace

std::exception_ptr to_c10_error(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error&) {
    return error;
  } catch (const std::exception& e) {
    return std::make_exception_ptr(c10::DistBackendError(
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, std::string("tdist: ") + e.what()));
  } catch (...) {
    return std::make_exception_ptr(c10::DistBackendError(
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, "tdist: unknown error"));
  }
}

// The CUDA devices of `ts`: a future whose value holds CUDA tensors must name them (c10's
// Future then records an event per device when it completes, and its users' streams wait on it;
// the staged results are already on the device by then: Note [Staging device tensors]).
std::vector<c10::Device> cuda_devices(const std::vector<at::Tensor>& ts) {
  std::vector<c10::Device> out;
  for (const auto& t : ts) {
    if (t.defined() && t.is_cuda() && std::find(out.begin(), out.end(), t.device()) == out.end()) {
      out.push_back(t.device());
    }
  }
  return out;
}

WorkAdapter::WorkAdapter(int rank, ::c10d::OpType op_type,
                         std::vector<std::shared_ptr<comm::Work>> works,
                         std::vector<at::Tensor> outputs, std::vector<at::Tensor> keep_alive,
                         int source_rank)
    : ::c10d::Work(rank, op_type),
      works_(std::move(works)),
      outputs_(std::move(outputs)),
      source_rank_(source_rank),
      done_(join(works_)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()), cuda_devices(outputs_))) {
  // See Note [Work and future adaptation]. The callback may run right here if done_ already is.
  done_->add_callback(
      [future = future_, outputs = outputs_, keep_alive = std::move(keep_alive)](comm::Future& f) {
        if (f.has_error()) {
          future->setError(to_c10_error(f.error()));
        } else {
          future->markCompleted(c10::IValue(outputs));
        }
      });
}

WorkAdapter::~WorkAdapter() = default;

void WorkAdapter::observe() const {
  for (const auto& w : works_) w->observe();
}

bool WorkAdapter::isCompleted() {
  observe();
  return future_->completed();
}

bool WorkAdapter::isSuccess() const {
  observe();
  return future_->completed() && !future_->hasError();
}

std::exception_ptr WorkAdapter::exception() const {
  observe();
  return future_->completed() ? future_->exception_ptr() : nullptr;
}

int WorkAdapter::sourceRank() const {
  if (opType_ == ::c10d::OpType::RECVANYSOURCE) {
    TORCH_CHECK(future_->completed(),
                "tdist: sourceRank() of recv_anysource is known once the receive completed; "
                "wait() first");
    return works_.at(0)->source_rank();
  }
  TORCH_CHECK(opType_ == ::c10d::OpType::RECV,
              "tdist: sourceRank() is only defined for recv and recv_anysource works, not ",
              ::c10d::opTypeToString(opType_));
  return source_rank_;
}

std::vector<at::Tensor> WorkAdapter::result() { return outputs_; }

bool WorkAdapter::wait(std::chrono::milliseconds timeout) {
  if (timeout != kC10dNoTimeout) {
    observe();
  } else {
    // Each operation runs on this thread when it is next due and the progress thread is idle
    // (Note [Waiter runs the operation] in comm/ring/op_queue.cpp); an error stops
    // here and is done_'s, rethrown below.
    for (const auto& w : works_) {
      try {
        w->wait();
      } catch (...) {
        break;
      }
    }
  }
  try {
    done_->wait(timeout == kC10dNoTimeout ? comm::Millis(-1) : timeout);
  } catch (const TimeoutError&) {
    if (done_->completed()) std::rethrow_exception(to_c10_error(std::current_exception()));
    // The wait gave up, not the operation: say which operation it was.
    C10_THROW_ERROR(
        DistBackendError,
        c10::str("tdist: rank ", rank_, ": wait(", timeout.count(), " ms) on ", describe(),
                 " gave up; the operation keeps running until its own deadline"));
  } catch (...) {
    std::rethrow_exception(to_c10_error(std::current_exception()));
  }
  // done_'s callback completes future_ right after done_ completes; wait for it so that the
  // future's value is readable when wait() returns.
  future_->wait();
  if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkAdapter::getFuture() {
  observe();
  return future_;
}

std::string WorkAdapter::describe() const {
  std::string out = ::c10d::opTypeToString(opType_);
  if (works_.size() == 1) {
    out += " (" + works_[0]->op() + ", seq " + std::to_string(works_[0]->sequence_number()) + ")";
  } else if (!works_.empty()) {
    out += " (" + std::to_string(works_.size()) + " operations, seq " +
           std::to_string(works_.front()->sequence_number()) + ".." +
           std::to_string(works_.back()->sequence_number()) + ")";
  }
  return out;
}

uint64_t WorkAdapter::getSequencenumber() const {
  return works_.empty() ? 0 : works_.back()->sequence_number();
}

}  // namespace tdist::c10d_backend
