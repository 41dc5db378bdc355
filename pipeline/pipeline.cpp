#include "tdist/pipeline/pipeline.h"

#include <torch/torch.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <cstring>
#include <mutex>

#include "tdist/comm/process_group.h"
#include "tdist/core/chrome_trace.h"
#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/pipeline/detail/split_backward.h"

namespace tdist::pipeline {

namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

// A layer's parameters that take gradients (zero-bubble's W computes theirs).
std::vector<at::Tensor> trainable_parameters(const torch::nn::Module& layer) {
  std::vector<at::Tensor> out;
  for (const auto& p : layer.parameters()) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

constexpr int kNoticeTag = kTagBase - 1;
// The last stage's word that an eval is complete (Pipeline::Impl::eval).
constexpr int kEvalDoneTag = kTagBase - 2;
constexpr int kSetupTagBase = kTagBase - 4096;  // + receiving stage
constexpr int64_t kNoticeBytes = 1024;
constexpr int kMaxDims = 12;
constexpr int64_t kHeaderLen = 4 + kMaxDims;  // status, failed stage, dtype, ndim, dims

// steady_clock's own epoch (CLOCK_MONOTONIC): the ranks of one host share it (timeline.h).
int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch())
      .count();
}

std::string shape_str(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// The error that another rank's notice carried: thrown as is on every rank it reaches.
class PeerFailure : public Error {
 public:
  using Error::Error;
};

}  // namespace

struct Pipeline::Impl {
  // Per (chunk, microbatch) state of one step.
  struct Slot {
    at::Tensor input;                    // the chunk's input (a leaf requiring grad after stage 0)
    at::Tensor output;                   // the chunk's output (the scaled loss on the last stage)
    std::vector<at::Tensor> layer_in;    // zero-bubble: each layer's input (a leaf)
    std::vector<at::Tensor> layer_out;   // zero-bubble: each layer's output (last: the loss)
    std::vector<at::Tensor> layer_grad;  // zero-bubble: each layer's output gradient (from I)
    // zero-bubble: each layer's split (null where I did not run: the first layer of stage 0)
    std::vector<std::shared_ptr<detail::LayerSplit>> layer_split;
    at::Tensor act_buf, grad_buf;
    std::shared_ptr<comm::Work> act_recv, grad_recv;
  };
  // Wakes a waiting step when a Work it waits on, or the failure notice, completes.
  struct Waker {
    std::mutex mu;
    std::condition_variable cv;
  };

  Impl(PipelineStage s, std::shared_ptr<comm::ProcessGroup> g, PipelineOptions o)
      : stage(std::move(s)), pg(std::move(g)), opts(std::move(o)) {}

  PipelineStage stage;
  std::shared_ptr<comm::ProcessGroup> pg;
  PipelineOptions opts;
  Schedule sched;
  int p = 1, S = 1, m = 1;
  Millis timeout{0};
  std::vector<int> last_weight_action;  // per chunk: index of its last B in the list (not split)

  // Set by setup():
  bool ready = false;
  int64_t batch = 0, micro = 0;
  std::vector<int64_t> sample_shape;
  std::vector<std::vector<int64_t>> in_shape, out_shape;  // per chunk
  std::vector<c10::ScalarType> in_dtype, out_dtype;

  // Failure notices (Note on failure in pipeline.h).
  std::shared_ptr<Waker> waker = std::make_shared<Waker>();
  at::Tensor notice_buf;
  std::shared_ptr<comm::Work> notice_recv;
  bool broken = false;
  std::string broken_reason;

  // Step state.
  std::vector<std::vector<Slot>> slots;  // [chunk][microbatch]
  std::vector<bool> posted;              // per action: its receive was posted
  // Per action index k: the actions whose receives are posted before action k runs
  // (Schedule::receive_post_index); constant after construction.
  std::vector<std::vector<size_t>> post_plan;
  // Zero-bubble: the W passes whose I ran, oldest first (Note [Pipeline schedules], "W
  // placement"), which of them ran early, and per chunk how many W ran this step.
  std::deque<Action> pending_w;
  std::vector<std::vector<bool>> w_done;  // [chunk][microbatch]
  std::vector<int> weights_done;          // per chunk
  struct Sent {
    std::shared_ptr<comm::Work> work;
    at::Tensor tensor;  // kept alive until the send completes
    int peer;
  };
  std::vector<Sent> sends;
  std::vector<at::Tensor> in_mb, tgt_mb;
  at::Tensor loss_sum;
  std::vector<StepTimeline> timelines;

  bool split() const { return opts.schedule == ScheduleKind::kZeroBubbleH1; }
  int rank_of(int s) const { return s % p; }
  std::string describe(int s) const { return stage.describe_stage(s); }
  std::string describe_rank(int r) const {
    if (stage.num_chunks() == 1) return describe(r);
    std::string out = str("rank ", r, " (stages");
    for (int c = 0; c < stage.num_chunks(); ++c) out += str(c ? ", " : " ", c * p + r);
    return out + ")";
  }
  int tag(int dir, int s, int i) const { return kTagBase + (i * S + s) * 2 + dir; }

  void post_notice_recv() {
    notice_buf = torch::zeros({kNoticeBytes}, torch::kUInt8);
    comm::SendRecvOptions o;
    o.timeout = Millis(int64_t(365) * 24 * 3600 * 1000);  // for the group's lifetime
    notice_recv = pg->recv_any_source(notice_buf, kNoticeTag, o);
    auto w = waker;
    notice_recv->future_unobserved()->add_callback([w](comm::Future&) {
      std::lock_guard<std::mutex> lock(w->mu);
      w->cv.notify_all();
    });
  }

  bool notice_arrived() const {
    auto f = notice_recv->future_unobserved();
    return f->completed() && !f->has_error();
  }
  [[noreturn]] void throw_notice() {
    std::string text(reinterpret_cast<const char*>(notice_buf.data_ptr<uint8_t>()),
                     static_cast<size_t>(kNoticeBytes));
    text = text.substr(0, text.find('\0'));
    broken = true;
    broken_reason = text;
    throw PeerFailure(str("pipeline: ", describe_rank(pg->rank()), " stops: ", text));
  }

  // Waits for `w` (an exchange with rank `peer`), or for another rank's failure notice.
  void wait(const std::shared_ptr<comm::Work>& w, int peer, const std::string& what) {
    auto wk = waker;
    auto fut = w->future();
    fut->add_callback([wk](comm::Future&) {
      std::lock_guard<std::mutex> lock(wk->mu);
      wk->cv.notify_all();
    });
    const auto deadline = Clock::now() + timeout + Millis(1000);
    {
      std::unique_lock<std::mutex> lock(waker->mu);
      waker->cv.wait_until(lock, deadline, [&] { return fut->completed() || notice_arrived(); });
    }
    if (notice_arrived()) throw_notice();
    if (!fut->completed()) {
      TDIST_THROW(TimeoutError, "pipeline: ", describe_rank(pg->rank()), " waited ",
                  timeout.count(), " ms for ", what, " of ", describe_rank(peer));
    }
    if (!fut->has_error()) return;
    // The peer may have failed first and said why: its notice comes before its connection
    // closes, so a short wait for it tells the root cause instead of the broken connection.
    {
      std::unique_lock<std::mutex> lock(waker->mu);
      waker->cv.wait_for(lock, Millis(500), [&] { return notice_arrived(); });
    }
    if (notice_arrived()) throw_notice();
    try {
      std::rethrow_exception(fut->error());
    } catch (const std::exception& e) {
      TDIST_THROW(Error, "pipeline: ", describe_rank(pg->rank()), " lost ", describe_rank(peer),
                  " during ", what, ": ", e.what());
    }
  }

  // Tells every other rank why this one stops (best effort, bounded), then marks it broken.
  void fail(const std::string& why) {
    broken = true;
    broken_reason = why;
    auto msg = torch::zeros({kNoticeBytes}, torch::kUInt8);
    std::memcpy(msg.data_ptr<uint8_t>(), why.data(),
                std::min<size_t>(why.size(), static_cast<size_t>(kNoticeBytes) - 1));
    std::vector<std::shared_ptr<comm::Work>> works;
    for (int r = 0; r < p; ++r) {
      if (r == pg->rank()) continue;
      try {
        works.push_back(pg->send(msg, r, kNoticeTag));
      } catch (const std::exception&) {}
    }
    const auto deadline = Clock::now() + std::min(timeout, Millis(5000));
    for (auto& w : works) {
      try {
        auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
        w->wait(std::max(left, Millis(1)));
      } catch (const std::exception&) {
        // That peer is gone or slow: the others still got theirs.
      }
    }
  }

  // Whether the message action `a` waits for (an activation or a gradient) is here, or it
  // waits for none.
  bool input_arrived(const Action& a) const {
    const int s = stage.stage_index(a.chunk);
    const Slot& slot = slots[a.chunk][a.microbatch];
    std::shared_ptr<comm::Work> w;
    if (a.type == Action::Type::kForward && s > 0) w = slot.act_recv;
    if ((a.type == Action::Type::kBackward || a.type == Action::Type::kBackwardInput) &&
        s + 1 < S) {
      w = slot.grad_recv;
    }
    return !w || w->is_completed();
  }

  void setup(const at::Tensor& sample);
  at::Tensor step(const at::Tensor& inputs, const at::Tensor& targets);
  Pipeline::EvalResult eval(const at::Tensor& inputs, const at::Tensor& targets);
  // step() and eval(): checks the batch and splits it into microbatches (in_mb on the first
  // stage's rank, tgt_mb on the last's, where targets are required or given).
  void split_batch(const char* what, const at::Tensor& inputs, const at::Tensor& targets,
                   bool targets_required);
  // Runs `body`; any failure but a peer's notice is told to every other rank and rethrown as
  // an Error naming this rank (Note on failure in pipeline.h).
  template <typename Body>
  void guarded(const char* what, Body body);
  void post_recvs(size_t from);
  // Posts the receive of the activation that chunk `c` (virtual stage s > 0) takes for
  // microbatch i, into its slot.
  void post_activation_recv(int c, int i);
  // Throws unless `y` is the output that set-up agreed on for chunk `c` (stage s).
  void check_output(const at::Tensor& y, int c, int s, int i) const;
  // loss_fn of the last stage's output for microbatch i, a scalar times 1/m.
  at::Tensor microbatch_loss(const at::Tensor& y, int i) const;
  void run(size_t index, const Action& a, StepTimeline& tl);
  void forward(const Action& a);
  void backward(size_t index, const Action& a);
  void backward_input(const Action& a);
  void backward_weight(const Action& a);
  void send(const at::Tensor& t, int to_stage, int dir, int i);
};

// ---- set-up ----

void Pipeline::Impl::setup(const at::Tensor& sample) {
  TDIST_CHECK_ARG(!broken, "pipeline is broken by an earlier failure: ", broken_reason);
  TDIST_CHECK_ARG(sample.defined() && sample.dim() >= 1,
                  "pipeline set-up needs a batch-shaped sample (at least 1 dimension)");
  batch = sample.size(0);
  TDIST_CHECK_ARG(batch % m == 0, "pipeline set-up: a batch of ", batch,
                  " samples cannot be split into ", m, " equal microbatches");
  micro = batch / m;
  sample_shape = sample.sizes().vec();
  const int v = stage.num_chunks();
  in_shape.assign(v, {});
  out_shape.assign(v, {});
  in_dtype.assign(v, sample.scalar_type());
  out_dtype.assign(v, sample.scalar_type());
  int failed = -1;  // the first stage (virtual) that could not take its input
  std::string local_error;
  struct HeaderSend {
    std::shared_ptr<comm::Work> work;
    at::Tensor header;
    int peer;
  };
  std::vector<HeaderSend> header_sends;
  torch::NoGradGuard no_grad;
  for (int c = 0; c < v; ++c) {
    const int s = stage.stage_index(c);
    at::Tensor x;
    if (s == 0) {
      x = sample.narrow(0, 0, micro);
    } else {
      auto h = torch::zeros({kHeaderLen}, torch::kInt64);
      auto w = pg->recv(h, rank_of(s - 1), kSetupTagBase + s);
      wait(w, rank_of(s - 1), str("the output shape of ", describe(s - 1)));
      auto* d = h.data_ptr<int64_t>();
      if (d[0] != 0) {
        failed = static_cast<int>(d[1]);
      } else {
        std::vector<int64_t> shape(d + 4, d + 4 + d[3]);
        x = torch::zeros(shape, torch::TensorOptions().dtype(static_cast<c10::ScalarType>(d[2])));
      }
    }
    at::Tensor y;
    if (failed < 0) {
      in_shape[c] = x.sizes().vec();
      in_dtype[c] = x.scalar_type();
      try {
        y = stage.chunk(c)->forward(x);
        TDIST_CHECK(y.dim() <= kMaxDims, "an output of ", y.dim(), " dimensions (at most ",
                    kMaxDims, ")");
        out_shape[c] = y.sizes().vec();
        out_dtype[c] = y.scalar_type();
      } catch (const std::exception& e) {
        // libtorch's errors carry a backtrace after their message: keep the message.
        const auto* te = dynamic_cast<const c10::Error*>(&e);
        const std::string cause = te ? te->what_without_backtrace() : e.what();
        failed = s;
        local_error = s == 0 ? str(describe(s), " cannot take the sample's microbatch of shape ",
                                   shape_str(x.sizes()), ": ", cause)
                             : str(describe(s), " cannot take the output of ", describe(s - 1),
                                   " of shape ", shape_str(x.sizes()), ": ", cause);
      }
    }
    if (s + 1 < S) {
      auto h = torch::zeros({kHeaderLen}, torch::kInt64);
      auto* d = h.data_ptr<int64_t>();
      if (failed >= 0) {
        d[0] = 1;
        d[1] = failed;
      } else {
        d[2] = static_cast<int64_t>(y.scalar_type());
        d[3] = y.dim();
        for (int64_t k = 0; k < y.dim(); ++k) d[4 + k] = y.size(k);
      }
      const int next = rank_of(s + 1);
      header_sends.push_back({pg->send(h, next, kSetupTagBase + s + 1), h, next});
    }
  }
  for (auto& h : header_sends) wait(h.work, h.peer, "the set-up message to it");
  // Every rank learns whether (and where) set-up failed.
  auto flag = torch::full({1}, static_cast<int64_t>(failed + 1), torch::kInt64);
  comm::AllreduceOptions ao;
  ao.op = comm::ReduceOp::MAX;
  ao.timeout = timeout;
  pg->allreduce(flag, ao)->wait();
  const int worst = static_cast<int>(flag.item<int64_t>()) - 1;
  if (worst >= 0) {
    if (!local_error.empty() && worst == failed) {
      TDIST_THROW(InvalidArgument, "pipeline set-up: ", local_error);
    }
    TDIST_THROW(InvalidArgument, "pipeline set-up: ", describe(worst),
                worst == 0 ? " cannot take the sample"
                           : str(" cannot take the output of ", describe(worst - 1)),
                " (the error is on rank ", rank_of(worst), ")");
  }
  ready = true;
}

// ---- one step ----

void Pipeline::Impl::send(const at::Tensor& t, int to_stage, int dir, int i) {
  auto c = t.contiguous();
  sends.push_back({pg->send(c, rank_of(to_stage), tag(dir, to_stage, i)), c, rank_of(to_stage)});
}

// Posts the receives that the plan puts before action `at` (Schedule::receive_post_index): a
// receive is posted when, in the simulated timetable, its sender starts producing the message,
// so the message lands in its buffer as soon as it is sent (a large send waits for the
// receive: Note [Point-to-point protocol]), and at the latest p actions ahead.
void Pipeline::Impl::post_recvs(size_t at) {
  const auto& list = sched.actions[static_cast<size_t>(pg->rank())];
  for (size_t k : post_plan[at]) {
    if (posted[k]) continue;
    posted[k] = true;
    const Action& a = list[k];
    const int s = stage.stage_index(a.chunk);
    Slot& slot = slots[a.chunk][a.microbatch];
    if (a.type == Action::Type::kForward && s > 0) {
      post_activation_recv(a.chunk, a.microbatch);
    } else if ((a.type == Action::Type::kBackward || a.type == Action::Type::kBackwardInput) &&
               s + 1 < S) {
      slot.grad_buf =
          torch::empty(out_shape[a.chunk], torch::TensorOptions().dtype(out_dtype[a.chunk]));
      slot.grad_recv = pg->recv(slot.grad_buf, rank_of(s + 1), tag(1, s, a.microbatch));
    }
  }
}

void Pipeline::Impl::post_activation_recv(int c, int i) {
  const int s = stage.stage_index(c);
  Slot& slot = slots[c][i];
  slot.act_buf = torch::empty(in_shape[c], torch::TensorOptions().dtype(in_dtype[c]));
  slot.act_recv = pg->recv(slot.act_buf, rank_of(s - 1), tag(0, s, i));
}

void Pipeline::Impl::check_output(const at::Tensor& y, int c, int s, int i) const {
  TDIST_CHECK(y.sizes().vec() == out_shape[c] && y.scalar_type() == out_dtype[c],
              "pipeline: ", describe(s), " produced ", shape_str(y.sizes()), " for microbatch ", i,
              " but set-up agreed on ", shape_str(out_shape[c]));
}

at::Tensor Pipeline::Impl::microbatch_loss(const at::Tensor& y, int i) const {
  at::Tensor loss = opts.loss_fn(y, tgt_mb[i]);
  TDIST_CHECK(loss.numel() == 1, "pipeline: loss_fn must return a scalar (got shape ",
              shape_str(loss.sizes()), ")");
  return loss.reshape({}) / static_cast<double>(m);
}

void Pipeline::Impl::forward(const Action& a) {
  const int s = stage.stage_index(a.chunk);
  const int i = a.microbatch;
  Slot& slot = slots[a.chunk][i];
  at::Tensor x = s == 0 ? in_mb[i] : slot.act_buf.requires_grad_(true);
  slot.act_buf = at::Tensor();
  slot.input = x;
  auto chunk = stage.chunk(a.chunk);
  at::Tensor y;
  if (split()) {
    at::Tensor h = x;
    for (size_t k = 0; k < chunk->size(); ++k) {
      if (k > 0) h = h.detach().requires_grad_(true);
      slot.layer_in.push_back(h);
      h = (chunk->begin() + static_cast<std::ptrdiff_t>(k))->forward(h);
      slot.layer_out.push_back(h);
    }
    y = h;
  } else {
    y = chunk->forward(x);
  }
  if (s + 1 == S) {
    at::Tensor loss = microbatch_loss(y, i);
    loss_sum = loss_sum.defined() ? loss_sum + loss.detach() : loss.detach();
    y = loss;
    if (split()) slot.layer_out.back() = loss;
  } else {
    check_output(y, a.chunk, s, i);
    send(y.detach(), s + 1, 0, i);
  }
  slot.output = y;
}

void Pipeline::Impl::backward(size_t index, const Action& a) {
  const int s = stage.stage_index(a.chunk);
  Slot& slot = slots[a.chunk][a.microbatch];
  std::vector<at::Tensor> roots{slot.output}, grads;
  if (s + 1 < S) grads.push_back(slot.grad_buf);
  if (opts.before_last_weight_pass && last_weight_action[a.chunk] == static_cast<int>(index)) {
    opts.before_last_weight_pass(a.chunk, roots);
  }
  torch::autograd::backward(roots, grads);
  if (s > 0) {
    // An output that does not depend on the input leaves its gradient undefined: zero.
    at::Tensor g = slot.input.grad();
    send(g.defined() ? g : torch::zeros_like(slot.input), s - 1, 1, a.microbatch);
  }
  slot = Slot{};
}

void Pipeline::Impl::backward_input(const Action& a) {
  const int s = stage.stage_index(a.chunk);
  Slot& slot = slots[a.chunk][a.microbatch];
  const size_t layers = slot.layer_out.size();
  auto chunk = stage.chunk(a.chunk);
  slot.layer_grad.assign(layers, at::Tensor());
  slot.layer_split.assign(layers, nullptr);
  at::Tensor g = s + 1 < S ? slot.grad_buf : torch::ones_like(slot.output);
  for (size_t k = layers; k-- > 0;) {
    slot.layer_grad[k] = g;
    if (k == 0 && s == 0) break;  // the model's input needs no gradient
    if (!slot.layer_out[k].requires_grad()) {
      g = torch::zeros_like(slot.layer_in[k]);  // this layer does not depend on its input
      continue;
    }
    slot.layer_split[k] = std::make_shared<detail::LayerSplit>(slot.layer_in[k], slot.layer_out[k],
                                                               trainable_parameters(*chunk[k]));
    g = torch::autograd::grad({slot.layer_out[k]}, {slot.layer_in[k]}, {g},
                              /*retain_graph=*/true, /*create_graph=*/false,
                              /*allow_unused=*/true)[0];
    if (!g.defined()) g = torch::zeros_like(slot.layer_in[k]);
  }
  if (s > 0) send(g, s - 1, 1, a.microbatch);
  slot.grad_buf = at::Tensor();
  pending_w.push_back(Action{Action::Type::kBackwardWeight, a.microbatch, a.chunk});
}

void Pipeline::Impl::backward_weight(const Action& a) {
  Slot& slot = slots[a.chunk][a.microbatch];
  auto chunk = stage.chunk(a.chunk);
  // The chunk's last W of the step, wherever it ran (W placement may move it). It is one
  // backward over every layer (what DDP's reducer, armed by the hook, takes for one pass); the
  // others start each layer's at its forks (detail::LayerSplit) where the graph allows.
  bool armed = false;
  if (opts.before_last_weight_pass) armed = ++weights_done[a.chunk] == m;
  std::vector<at::Tensor> roots, grads, params;
  for (size_t k = 0; k < slot.layer_out.size(); ++k) {
    std::vector<at::Tensor> ps = trainable_parameters(*chunk[k]);
    if (ps.empty() || !slot.layer_out[k].requires_grad()) continue;
    detail::LayerSplit* split = k < slot.layer_split.size() ? slot.layer_split[k].get() : nullptr;
    if (!armed && split && split->exact()) {
      split->weight_grads();
      continue;
    }
    roots.push_back(slot.layer_out[k]);
    grads.push_back(slot.layer_grad[k]);
    params.insert(params.end(), ps.begin(), ps.end());
  }
  if (armed) opts.before_last_weight_pass(a.chunk, roots);
  w_done[a.chunk][a.microbatch] = true;
  if (!roots.empty()) {
    torch::autograd::backward(roots, grads, /*retain_graph=*/false, /*create_graph=*/false, params);
  }
  slot = Slot{};
}

void Pipeline::Impl::run(size_t index, const Action& a, StepTimeline& tl) {
  const int s = stage.stage_index(a.chunk);
  Slot& slot = slots[a.chunk][a.microbatch];
  const std::string name = to_string(a, stage.num_chunks() > 1);
  const int64_t t0 = now_us();
  if (a.type == Action::Type::kForward && s > 0) {
    wait(slot.act_recv, rank_of(s - 1), str("the activation of microbatch ", a.microbatch));
    slot.act_recv.reset();
  } else if ((a.type == Action::Type::kBackward || a.type == Action::Type::kBackwardInput) &&
             s + 1 < S) {
    wait(slot.grad_recv, rank_of(s + 1), str("the gradient of microbatch ", a.microbatch));
    slot.grad_recv.reset();
  }
  const int64_t t1 = now_us();
  if (t1 > t0) tl.events.push_back({"wait " + name, t0, t1, false});
  switch (a.type) {
    case Action::Type::kForward:
      forward(a);
      break;
    case Action::Type::kBackward:
      backward(index, a);
      break;
    case Action::Type::kBackwardInput:
      backward_input(a);
      break;
    case Action::Type::kBackwardWeight:
      backward_weight(a);
      break;
  }
  tl.events.push_back({name, t1, now_us(), true});
}

void Pipeline::Impl::split_batch(const char* what, const at::Tensor& inputs,
                                 const at::Tensor& targets, bool targets_required) {
  const int v = stage.num_chunks();
  in_mb.clear();
  tgt_mb.clear();
  if (stage.stage_index(0) == 0) {
    TDIST_CHECK_ARG(inputs.defined() && inputs.sizes().vec() == sample_shape, "pipeline ", what,
                    ": the first stage's inputs must be shaped like the set-up sample ",
                    shape_str(sample_shape), " (got ",
                    inputs.defined() ? shape_str(inputs.sizes()) : std::string("none"), ")");
    in_mb = inputs.split(micro, 0);
  }
  if (stage.stage_index(v - 1) == S - 1 && (targets_required || targets.defined())) {
    TDIST_CHECK_ARG(targets.defined() && targets.dim() >= 1 && targets.size(0) == batch,
                    "pipeline ", what, ": the last stage's targets must hold ", batch, " samples");
    tgt_mb = targets.split(micro, 0);
  }
}

template <typename Body>
void Pipeline::Impl::guarded(const char* what, Body body) {
  TDIST_CHECK_ARG(!broken, "pipeline is broken by an earlier failure: ", broken_reason);
  TDIST_CHECK_ARG(ready, "pipeline: call setup() before ", what, "()");
  try {
    body();
  } catch (const PeerFailure&) {
    throw;
  } catch (const std::exception& e) {
    const std::string why = str(describe_rank(pg->rank()), " failed: ", e.what());
    fail(why);
    TDIST_THROW(Error, "pipeline ", what, ": ", why);
  }
}

at::Tensor Pipeline::Impl::step(const at::Tensor& inputs, const at::Tensor& targets) {
  StepTimeline tl;
  tl.rank = pg->rank();
  tl.begin_us = now_us();
  const int v = stage.num_chunks();
  guarded("step", [&] {
    split_batch("step", inputs, targets, /*targets_required=*/true);
    loss_sum = at::Tensor();
    const auto& list = sched.actions[static_cast<size_t>(pg->rank())];
    slots.assign(v, std::vector<Slot>(m));
    posted.assign(list.size(), false);
    sends.clear();
    pending_w.clear();
    w_done.assign(v, std::vector<bool>(m, false));
    weights_done.assign(v, 0);
    for (size_t k = 0; k < list.size(); ++k) {
      post_recvs(k);
      const Action& a = list[k];
      if (split()) {
        if (a.type == Action::Type::kBackwardWeight && w_done[a.chunk][a.microbatch]) continue;
        // W placement: while this action's input has not arrived, run pending W passes.
        while (!pending_w.empty() && !input_arrived(a)) {
          const Action w = pending_w.front();
          pending_w.pop_front();
          if (!w_done[w.chunk][w.microbatch]) run(k, w, tl);
        }
      }
      run(k, a, tl);
    }
    const int64_t t0 = now_us();
    for (auto& sent : sends) wait(sent.work, sent.peer, "a send to it");
    sends.clear();
    if (now_us() > t0) tl.events.push_back({"wait sends", t0, now_us(), false});
  });
  tl.end_us = now_us();
  timelines.push_back(std::move(tl));
  slots.clear();
  return loss_sum;
}

// Forward only (Pipeline::eval): this rank's forwards in the order of its step's list, which
// cannot deadlock for the reason the list cannot (each forward's input comes from an earlier
// forward). Every activation's receive is posted at once: nothing is stashed for a backward,
// so a rank holds at most its m received activations, as GPipe's step does. No rank waits for
// a later stage in the forwards, so the last stage's rank ends by telling every other rank it
// is done (one byte): eval returns nowhere before the outputs exist, and a stage lost on the
// way fails every rank's eval (the last stage's notice, or the lost done message) rather than
// a later call.
Pipeline::EvalResult Pipeline::Impl::eval(const at::Tensor& inputs, const at::Tensor& targets) {
  torch::NoGradGuard no_grad;
  const int v = stage.num_chunks();
  std::vector<at::Tensor> outputs(static_cast<size_t>(m));
  at::Tensor loss;
  guarded("eval", [&] {
    split_batch("eval", inputs, targets, /*targets_required=*/false);
    std::vector<Action> forwards;
    for (const Action& a : sched.actions[static_cast<size_t>(pg->rank())]) {
      if (a.type == Action::Type::kForward) forwards.push_back(a);
    }
    slots.assign(v, std::vector<Slot>(m));
    sends.clear();
    const int last_rank = rank_of(S - 1);
    auto done = torch::zeros({1}, torch::kUInt8);
    std::shared_ptr<comm::Work> done_recv;
    if (pg->rank() != last_rank) done_recv = pg->recv(done, last_rank, kEvalDoneTag);
    for (const Action& a : forwards) {
      if (stage.stage_index(a.chunk) > 0) post_activation_recv(a.chunk, a.microbatch);
    }
    for (const Action& a : forwards) {
      const int s = stage.stage_index(a.chunk);
      const int i = a.microbatch;
      Slot& slot = slots[a.chunk][i];
      if (s > 0) wait(slot.act_recv, rank_of(s - 1), str("the activation of microbatch ", i));
      at::Tensor y = stage.chunk(a.chunk)->forward(s == 0 ? in_mb[i] : slot.act_buf);
      slot = Slot{};
      if (s + 1 < S) {
        check_output(y, a.chunk, s, i);
        send(y, s + 1, 0, i);
        continue;
      }
      outputs[static_cast<size_t>(i)] = y;
      if (tgt_mb.empty()) continue;
      at::Tensor l = microbatch_loss(y, i);
      loss = loss.defined() ? loss + l : l;
    }
    if (pg->rank() == last_rank) {
      for (int r = 0; r < p; ++r) {
        if (r != last_rank) sends.push_back({pg->send(done, r, kEvalDoneTag), done, r});
      }
    }
    for (auto& sent : sends) wait(sent.work, sent.peer, "a send to it");
    sends.clear();
    if (done_recv) wait(done_recv, last_rank, "the end of eval");
  });
  slots.clear();
  Pipeline::EvalResult r;
  if (stage.stage_index(v - 1) == S - 1) {
    r.output = at::cat(outputs, 0);
    r.loss = loss;
  }
  return r;
}

// ---- Pipeline ----

Pipeline::Pipeline(PipelineStage stage, std::shared_ptr<comm::ProcessGroup> pg,
                   PipelineOptions opts)
    : impl_(std::make_unique<Impl>(std::move(stage), std::move(pg), std::move(opts))) {
  Impl& d = *impl_;
  TDIST_CHECK_ARG(d.pg != nullptr, "pipeline: no process group");
  // Its own subgroup of the same ranks (a collective): the pipeline's tags and its posted
  // failure-notice receive never meet the caller's messages, and both go away with it.
  {
    std::vector<int> all(static_cast<size_t>(d.pg->size()));
    for (int r = 0; r < d.pg->size(); ++r) all[static_cast<size_t>(r)] = r;
    d.pg = d.pg->new_group(all);
  }
  TDIST_CHECK_ARG(d.pg->size() == d.stage.num_ranks() && d.pg->rank() == d.stage.rank(),
                  "pipeline: the stage is rank ", d.stage.rank(), " of ", d.stage.num_ranks(),
                  " but the group's rank is ", d.pg->rank(), " of ", d.pg->size());
  TDIST_CHECK_ARG(d.opts.microbatches >= 1, "pipeline: microbatches must be >= 1 (got ",
                  d.opts.microbatches, ")");
  TDIST_CHECK_ARG(static_cast<bool>(d.opts.loss_fn), "pipeline: options.loss_fn is required");
  d.p = d.pg->size();
  d.S = d.stage.num_stages();
  d.m = d.opts.microbatches;
  TDIST_CHECK_ARG(d.S < 4000 && static_cast<int64_t>(d.m) * d.S * 2 < (int64_t(1) << 30),
                  "pipeline: ", d.m, " microbatches x ", d.S, " stages exceed the tag space");
  d.sched = make_schedule(d.opts.schedule, d.p, d.m, d.stage.num_chunks());
  d.timeout = d.opts.timeout.count() >= 0 ? d.opts.timeout : d.pg->options().timeout;
  if (d.opts.trace_path.empty()) d.opts.trace_path = env::get("TDIST_PIPELINE_TRACE").value_or("");
  d.last_weight_action.assign(d.stage.num_chunks(), -1);
  const auto& list = d.sched.actions[static_cast<size_t>(d.pg->rank())];
  for (size_t k = 0; k < list.size(); ++k) {
    if (list[k].type == Action::Type::kBackward) {
      d.last_weight_action[list[k].chunk] = static_cast<int>(k);
    }
  }
  const auto post_index = d.sched.receive_post_index(d.pg->rank(), d.p);
  d.post_plan.assign(list.size(), {});
  for (size_t k = 0; k < list.size(); ++k) d.post_plan[post_index[k]].push_back(k);
  d.post_notice_recv();
}

Pipeline::~Pipeline() {
  // A send completes once its bytes are written (a small one before the receiver read them),
  // so a rank done with its last step may still owe a peer a message that peer has not read:
  // closing the subgroup now could fail the peer's receive. Every rank leaves together, unless
  // an exception unwinds the caller (say, its stage's reduce-scatter lost a replica): then the
  // others would wait for this rank's messages until their timeout, so they are told at once.
  if (!impl_->broken && std::uncaught_exceptions() > 0) {
    impl_->fail(str(impl_->describe_rank(impl_->pg->rank()),
                    " left the pipeline: an error outside the pipeline stopped its caller"));
  }
  if (!impl_->broken) {
    try {
      comm::BarrierOptions o;
      o.timeout = impl_->timeout;
      impl_->pg->barrier(o)->wait();
    } catch (const std::exception& e) {
      TDIST_LOG_WARN("pipeline: leaving without the other stages: ", e.what());
    }
  }
  if (!impl_->opts.trace_path.empty() && !impl_->timelines.empty()) {
    try {
      write_trace();
    } catch (const std::exception& e) {
      TDIST_LOG_WARN("pipeline trace: ", e.what());
    }
  }
}

void Pipeline::setup(const at::Tensor& sample) {
  try {
    impl_->setup(sample);
  } catch (const InvalidArgument&) {
    throw;
  } catch (const PeerFailure&) {
    throw;
  } catch (const std::exception& e) {
    const std::string why =
        str(impl_->describe_rank(impl_->pg->rank()), " failed at set-up: ", e.what());
    impl_->fail(why);
    TDIST_THROW(Error, "pipeline: ", why);
  }
}

at::Tensor Pipeline::step(const at::Tensor& inputs, const at::Tensor& targets) {
  return impl_->step(inputs, targets);
}

Pipeline::EvalResult Pipeline::eval(const at::Tensor& inputs, const at::Tensor& targets) {
  return impl_->eval(inputs, targets);
}

PipelineStage& Pipeline::stage() { return impl_->stage; }
const Schedule& Pipeline::schedule() const { return impl_->sched; }

const StepTimeline& Pipeline::last_timeline() const {
  TDIST_CHECK_ARG(!impl_->timelines.empty(), "pipeline: no step has run yet");
  return impl_->timelines.back();
}

void Pipeline::write_trace(const std::string& path) const {
  const std::string pattern = path.empty() ? impl_->opts.trace_path : path;
  TDIST_CHECK_ARG(!pattern.empty(),
                  "pipeline: no trace path (options.trace_path, "
                  "TDIST_PIPELINE_TRACE or the argument)");
  pipeline::write_trace(trace_path_for_rank(pattern, impl_->pg->rank()), impl_->pg->rank(),
                        impl_->timelines);
}

}  // namespace tdist::pipeline
