#include "tdist/pipeline/schedule.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <sstream>

#include "tdist/core/error.h"

namespace tdist::pipeline {

ScheduleKind parse_schedule(const std::string& name) {
  if (name == "gpipe") return ScheduleKind::kGPipe;
  if (name == "1f1b") return ScheduleKind::k1F1B;
  if (name == "interleaved" || name == "interleaved1f1b") return ScheduleKind::kInterleaved1F1B;
  if (name == "zb" || name == "zbh1") return ScheduleKind::kZeroBubbleH1;
  TDIST_THROW(InvalidArgument, "unknown pipeline schedule '", name,
              "' (known: gpipe, 1f1b, interleaved, zb)");
}

std::string to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe:
      return "gpipe";
    case ScheduleKind::k1F1B:
      return "1f1b";
    case ScheduleKind::kInterleaved1F1B:
      return "interleaved";
    case ScheduleKind::kZeroBubbleH1:
      return "zb";
  }
  return "?";
}

std::string to_string(const Action& a, bool with_chunk) {
  static const char kLetter[] = {'F', 'B', 'I', 'W'};
  std::string s = std::string(1, kLetter[static_cast<int>(a.type)]) + std::to_string(a.microbatch);
  if (with_chunk) s += "." + std::to_string(a.chunk);
  return s;
}

double analytic_bubble(int num_ranks, int num_microbatches) {
  return static_cast<double>(num_ranks - 1) / (num_microbatches + num_ranks - 1);
}

namespace {

constexpr int64_t kNotDone = std::numeric_limits<int64_t>::max();

int cost(Action::Type t) { return t == Action::Type::kBackward ? 2 : 1; }

// The list scheduler of Note [Pipeline schedules]: every rank that is free at time t starts the
// action its rule picks among those whose inputs exist at t.
class Simulation {
 public:
  Simulation(ScheduleKind kind, int p, int m, int v, int extra_warmup)
      : kind_(kind),
        p_(p),
        m_(m),
        v_(v),
        S_(p * v),
        extra_warmup_(extra_warmup),
        fwd_(S_, std::vector<int64_t>(m, kNotDone)),
        bwd_(S_, std::vector<int64_t>(m, kNotDone)),
        wgt_(S_, std::vector<int64_t>(m, kNotDone)) {
    if (kind == ScheduleKind::kInterleaved1F1B) {
      for (int r = 0; r < p_; ++r) sequence_.push_back(interleaved_sequence(r));
      next_.assign(p_, 0);
    }
  }

  std::optional<Schedule> run() {
    Schedule out{
        kind_, p_, m_, v_, std::vector<std::vector<Action>>(p_), std::vector<std::vector<int>>(p_)};
    const bool split = kind_ == ScheduleKind::kZeroBubbleH1;
    const int64_t total = static_cast<int64_t>(S_) * m_ * (split ? 3 : 2);
    int64_t done = 0;
    std::vector<int64_t> busy_until(p_, 0);
    std::vector<int> in_flight(p_, 0);
    std::vector<int> forwards_done(p_, 0);
    // Released (B, or W when split) at the end of the action: the finish times are set at
    // start, so readiness checks compare them with the current time.
    for (int64_t t = 0; done < total; ++t) {
      bool any_busy = false;
      bool any_started = false;
      for (int r = 0; r < p_; ++r) {
        if (busy_until[r] > t) {
          any_busy = true;
          continue;
        }
        auto a = pick(r, t, in_flight[r], forwards_done[r]);
        if (!a) continue;
        start(*a, r, t, out, busy_until, in_flight, forwards_done);
        any_started = true;
        ++done;
      }
      // Every rank free and none may start: the order cannot finish (interleaved's warm-up is
      // too short for this m; make_schedule retries with a longer one).
      if (!any_busy && !any_started) return std::nullopt;
      for (int r = 0; r < p_; ++r) {
        if (static_cast<int64_t>(out.timetable[r].size()) <= t) out.timetable[r].push_back(-1);
      }
    }
    // Trim the idle tail.
    size_t makespan = 0;
    for (auto& row : out.timetable) {
      size_t last = row.size();
      while (last > 0 && row[last - 1] < 0) --last;
      makespan = std::max(makespan, last);
    }
    for (auto& row : out.timetable) row.resize(makespan, -1);
    return out;
  }

 private:
  int stage(int r, int chunk) const { return chunk * p_ + r; }

  // Megatron's interleaved order: groups of p microbatches, chunk-major within a group.
  int64_t fkey(int i, int c) const { return (static_cast<int64_t>(i / p_) * v_ + c) * p_ + i % p_; }
  int64_t bkey(int i, int c) const {
    return (static_cast<int64_t>(i / p_) * v_ + (v_ - 1 - c)) * p_ + i % p_;
  }

  int cap(int r) const {
    switch (kind_) {
      case ScheduleKind::kGPipe:
        return std::numeric_limits<int>::max();
      case ScheduleKind::k1F1B:
      case ScheduleKind::kZeroBubbleH1:
        return p_ - r;
      case ScheduleKind::kInterleaved1F1B:
        return (v_ - 1) * p_ + 2 * (p_ - 1 - r) + 1;
    }
    return 1;
  }

  bool f_ready(int s, int i, int64_t t) const {
    return fwd_[s][i] == kNotDone && (s == 0 || fwd_[s - 1][i] <= t);
  }
  bool b_ready(int s, int i, int64_t t) const {
    return bwd_[s][i] == kNotDone && fwd_[s][i] <= t && (s == S_ - 1 || bwd_[s + 1][i] <= t);
  }
  bool w_ready(int s, int i, int64_t t) const { return wgt_[s][i] == kNotDone && bwd_[s][i] <= t; }

  std::optional<Action> best(int r, int64_t t, Action::Type type) const {
    std::optional<Action> found;
    int64_t key = std::numeric_limits<int64_t>::max();
    for (int c = 0; c < v_; ++c) {
      const int s = stage(r, c);
      for (int i = 0; i < m_; ++i) {
        bool ok = false;
        int64_t k = 0;
        if (type == Action::Type::kForward) {
          ok = f_ready(s, i, t);
          k = fkey(i, c);
        } else if (type == Action::Type::kBackwardWeight) {
          ok = w_ready(s, i, t);
          k = bkey(i, c);
        } else {
          ok = b_ready(s, i, t);
          k = bkey(i, c);
        }
        if (ok && k < key) {
          key = k;
          found = Action{type, i, c};
        }
      }
    }
    return found;
  }

  // Megatron's interleaved 1F1B for rank r: warm-up forwards, then one forward and one backward
  // in turn, then the remaining backwards; forwards in fkey order, backwards in bkey order.
  std::vector<Action> interleaved_sequence(int r) const {
    std::vector<Action> f, b;
    for (int c = 0; c < v_; ++c) {
      for (int i = 0; i < m_; ++i) {
        f.push_back(Action{Action::Type::kForward, i, c});
        b.push_back(Action{Action::Type::kBackward, i, c});
      }
    }
    std::stable_sort(f.begin(), f.end(), [&](const Action& x, const Action& y) {
      return fkey(x.microbatch, x.chunk) < fkey(y.microbatch, y.chunk);
    });
    std::stable_sort(b.begin(), b.end(), [&](const Action& x, const Action& y) {
      return bkey(x.microbatch, x.chunk) < bkey(y.microbatch, y.chunk);
    });
    const size_t total = f.size();
    const size_t warmup = std::min<size_t>(total, static_cast<size_t>(cap(r) - 1 + extra_warmup_));
    std::vector<Action> seq(f.begin(), f.begin() + static_cast<std::ptrdiff_t>(warmup));
    size_t nf = warmup, nb = 0;
    while (nf < total) {
      seq.push_back(f[nf++]);
      seq.push_back(b[nb++]);
    }
    while (nb < total) seq.push_back(b[nb++]);
    return seq;
  }

  std::optional<Action> pick(int r, int64_t t, int in_flight, int forwards_done) const {
    if (kind_ == ScheduleKind::kInterleaved1F1B) {
      if (next_[r] >= sequence_[r].size()) return std::nullopt;
      const Action& a = sequence_[r][next_[r]];
      const int s = stage(r, a.chunk);
      const bool ok = a.type == Action::Type::kForward ? f_ready(s, a.microbatch, t)
                                                       : b_ready(s, a.microbatch, t);
      if (ok) return a;
      return std::nullopt;
    }
    const bool split = kind_ == ScheduleKind::kZeroBubbleH1;
    const auto back = split ? Action::Type::kBackwardInput : Action::Type::kBackward;
    const bool may_forward = in_flight < cap(r);
    if (kind_ == ScheduleKind::kGPipe) {
      if (auto f = best(r, t, Action::Type::kForward)) return f;
      if (forwards_done < m_ * v_) return std::nullopt;  // every forward first
      return best(r, t, back);
    }
    if (auto b = best(r, t, back)) return b;
    if (may_forward) {
      if (auto f = best(r, t, Action::Type::kForward)) return f;
    }
    if (split) return best(r, t, Action::Type::kBackwardWeight);
    return std::nullopt;
  }

  void start(const Action& a, int r, int64_t t, Schedule& out, std::vector<int64_t>& busy_until,
             std::vector<int>& in_flight, std::vector<int>& forwards_done) {
    const int s = stage(r, a.chunk);
    const int64_t end = t + cost(a.type);
    switch (a.type) {
      case Action::Type::kForward:
        fwd_[s][a.microbatch] = end;
        ++in_flight[r];
        ++forwards_done[r];
        break;
      case Action::Type::kBackward:
        bwd_[s][a.microbatch] = end;
        --in_flight[r];
        break;
      case Action::Type::kBackwardInput:
        bwd_[s][a.microbatch] = end;
        break;
      case Action::Type::kBackwardWeight:
        wgt_[s][a.microbatch] = end;
        --in_flight[r];
        break;
    }
    if (!sequence_.empty()) ++next_[r];
    const int index = static_cast<int>(out.actions[r].size());
    out.actions[r].push_back(a);
    auto& row = out.timetable[r];
    row.resize(static_cast<size_t>(t), -1);
    for (int k = 0; k < cost(a.type); ++k) row.push_back(index);
    busy_until[r] = end;
  }

  const ScheduleKind kind_;
  const int p_, m_, v_, S_;
  const int extra_warmup_;
  // Finish time of each action per (virtual stage, microbatch); kNotDone until started.
  std::vector<std::vector<int64_t>> fwd_, bwd_, wgt_;
  // Interleaved only: each rank's fixed order and the index of its next action.
  std::vector<std::vector<Action>> sequence_;
  std::vector<size_t> next_;
};

}  // namespace

Schedule make_schedule(ScheduleKind kind, int num_ranks, int num_microbatches, int num_chunks) {
  TDIST_CHECK_ARG(num_ranks >= 1, "a pipeline needs at least 1 stage (got ", num_ranks, ")");
  TDIST_CHECK_ARG(num_microbatches >= 1, "a pipeline needs at least 1 microbatch (got ",
                  num_microbatches, ")");
  if (kind == ScheduleKind::kInterleaved1F1B) {
    TDIST_CHECK_ARG(num_chunks >= 2,
                    "the interleaved schedule needs at least 2 chunks per rank (got ", num_chunks,
                    ")");
  } else {
    TDIST_CHECK_ARG(num_chunks == 1, "schedule ", to_string(kind), " runs one chunk per rank (got ",
                    num_chunks, "); use interleaved");
  }
  // Megatron's interleaved order assumes m % p == 0; for other m its warm-up can be too short
  // to reach the first backward. Every rank computes the same lists, so each retries alike.
  const int most = num_microbatches * num_chunks;
  for (int extra = 0; extra <= most; ++extra) {
    if (auto s = Simulation(kind, num_ranks, num_microbatches, num_chunks, extra).run()) return *s;
  }
  TDIST_THROW(Error, "pipeline schedule ", to_string(kind), " cannot order p=", num_ranks,
              " m=", num_microbatches, " v=", num_chunks);
}

double Schedule::simulated_bubble() const {
  if (timetable.empty() || timetable[0].empty()) return 0.0;
  int64_t idle = 0, all = 0;
  for (const auto& row : timetable) {
    for (int x : row) idle += x < 0 ? 1 : 0;
    all += static_cast<int64_t>(row.size());
  }
  return static_cast<double>(idle) / static_cast<double>(all);
}

std::vector<int> Schedule::peak_in_flight() const {
  std::vector<int> peak(actions.size(), 0);
  for (size_t r = 0; r < actions.size(); ++r) {
    int now = 0;
    for (const Action& a : actions[r]) {
      if (a.type == Action::Type::kForward) ++now;
      if (a.type == Action::Type::kBackward || a.type == Action::Type::kBackwardWeight) --now;
      peak[r] = std::max(peak[r], now);
    }
  }
  return peak;
}

std::vector<size_t> Schedule::receive_post_index(int rank, int window) const {
  const int p = num_ranks, v = num_chunks, m = num_microbatches;
  const int S = p * v;
  // Simulated start of every action, by rank and action index (rising along each list), and by
  // (rank, type, chunk, microbatch).
  std::vector<std::vector<int64_t>> start(actions.size());
  std::vector<int64_t> start_by_key(static_cast<size_t>(p) * 4 * v * m, -1);
  auto key = [&](int r, Action::Type type, int chunk, int microbatch) {
    return ((static_cast<size_t>(r) * 4 + static_cast<size_t>(type)) * v + chunk) * m + microbatch;
  };
  for (size_t r = 0; r < actions.size(); ++r) {
    start[r].assign(actions[r].size(), 0);
    for (size_t t = timetable[r].size(); t-- > 0;) {
      if (timetable[r][t] >= 0) {
        start[r][static_cast<size_t>(timetable[r][t])] = static_cast<int64_t>(t);
      }
    }
    for (size_t k = 0; k < actions[r].size(); ++k) {
      const Action& a = actions[r][k];
      start_by_key[key(static_cast<int>(r), a.type, a.chunk, a.microbatch)] = start[r][k];
    }
  }
  const auto& mine = actions[static_cast<size_t>(rank)];
  const auto& my_start = start[static_cast<size_t>(rank)];
  std::vector<size_t> out(mine.size());
  for (size_t k = 0; k < mine.size(); ++k) {
    const Action& a = mine[k];
    out[k] = k;
    const int s = a.chunk * p + rank;
    int q = -1;  // the stage that sends this action's message
    if (a.type == Action::Type::kForward && s > 0) q = s - 1;
    if ((a.type == Action::Type::kBackward || a.type == Action::Type::kBackwardInput) &&
        s + 1 < S) {
      q = s + 1;
    }
    if (q < 0) continue;
    const int64_t produced = start_by_key[key(q % p, a.type, q / p, a.microbatch)];
    // The last of this rank's actions that starts no later than the producer (0 if none).
    const auto after = std::upper_bound(
        my_start.begin(), my_start.begin() + static_cast<std::ptrdiff_t>(k), produced);
    const size_t at =
        after == my_start.begin() ? 0 : static_cast<size_t>(after - my_start.begin()) - 1;
    const size_t latest = k > static_cast<size_t>(window) ? k - static_cast<size_t>(window) : 0;
    out[k] = std::min(at, latest);
  }
  return out;
}

std::string Schedule::format() const {
  const bool chunks = num_chunks > 1;
  const size_t width = chunks ? 5 : 3;
  std::ostringstream os;
  for (size_t r = 0; r < timetable.size(); ++r) {
    os << "rank " << r << " |";
    for (int x : timetable[r]) {
      std::string cell = x < 0 ? "." : to_string(actions[r][static_cast<size_t>(x)], chunks);
      cell.resize(width, ' ');
      os << cell;
    }
    os << "\n";
  }
  return os.str();
}

}  // namespace tdist::pipeline
