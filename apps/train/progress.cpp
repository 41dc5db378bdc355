#include "apps/train/progress.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "tdist/core/error.h"

namespace tdist::train {
namespace {

constexpr int kBarWidth = 24;

// Rounds for the metrics file (enough digits to be useful, short lines).
double round_to(double v, int digits) {
  const double scale = std::pow(10.0, digits);
  return std::round(v * scale) / scale;
}

}  // namespace

ProgressMode parse_progress_mode(const std::string& s) {
  if (s == "auto") return ProgressMode::kAuto;
  if (s == "bar") return ProgressMode::kBar;
  if (s == "log") return ProgressMode::kLog;
  if (s == "none") return ProgressMode::kNone;
  throw InvalidArgument("--progress must be auto, bar, log or none (got '" + s + "')");
}

std::string format_duration(double seconds) {
  if (!(seconds >= 0) || !std::isfinite(seconds)) return "?";
  auto total = static_cast<int64_t>(std::llround(seconds));
  const int64_t h = total / 3600, m = (total / 60) % 60, s = total % 60;
  char buf[48];
  if (h > 0) {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", static_cast<long long>(h),
                  static_cast<long long>(m), static_cast<long long>(s));
  } else {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld", static_cast<long long>(m),
                  static_cast<long long>(s));
  }
  return buf;
}

Progress::Progress(ProgressMode mode, bool active, const std::string& metrics_path)
    : active_(active), mode_(mode) {
  if (!active_) return;
  if (mode_ == ProgressMode::kAuto) {
    mode_ = ::isatty(STDOUT_FILENO) ? ProgressMode::kBar : ProgressMode::kLog;
  }
  if (!metrics_path.empty()) {
    // Appended to, never through a link planted at its name; created 0600.
    const int fd =
        ::open(metrics_path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    metrics_ = fd >= 0 ? ::fdopen(fd, "a") : nullptr;
    if (fd >= 0 && !metrics_) ::close(fd);
    if (!metrics_) {
      throw InvalidArgument("cannot open --metrics file '" + metrics_path +
                            "': " + std::strerror(errno));
    }
  }
}

Progress::~Progress() {
  finish();
  if (metrics_) std::fclose(metrics_);
}

void Progress::report(const StepReport& r) {
  if (!active_) return;
  if (metrics_) {
    nlohmann::json j = {
        {"event", "train"},
        {"step", r.step},
        {"epoch", r.epoch},
        {"loss", r.loss},
        {"train_accuracy", round_to(r.train_accuracy, 6)},
        {"samples_per_sec", round_to(r.samples_per_sec, 1)},
        {"data_ms", round_to(r.data_ms, 3)},
        {"forward_ms", round_to(r.forward_ms, 3)},
        {"backward_ms", round_to(r.backward_ms, 3)},
        {"comm_wait_ms", round_to(r.comm_wait_ms, 3)},
        {"optimizer_ms", round_to(r.optimizer_ms, 3)},
        {"time_s", round_to(r.elapsed_s, 3)},
    };
    metrics_line(j.dump());
  }
  char line[512];
  if (mode_ == ProgressMode::kBar) {
    const double frac =
        r.total_steps > 0 ? static_cast<double>(r.step) / static_cast<double>(r.total_steps) : 1.0;
    const int filled = static_cast<int>(frac * kBarWidth);
    std::string bar(static_cast<size_t>(kBarWidth), ' ');
    for (int i = 0; i < filled && i < kBarWidth; ++i) bar[static_cast<size_t>(i)] = '=';
    if (filled < kBarWidth) bar[static_cast<size_t>(filled)] = '>';
    std::snprintf(
        line, sizeof(line),
        "\rstep %lld/%lld [%s] %3.0f%% | loss %.4f | acc %5.1f%% | %.0f samples/s | ETA %s\x1b[K",
        static_cast<long long>(r.step), static_cast<long long>(r.total_steps), bar.c_str(),
        100.0 * frac, r.loss, 100.0 * r.train_accuracy, r.samples_per_sec,
        format_duration(r.eta_s).c_str());
    std::fputs(line, stdout);
    std::fflush(stdout);
    bar_open_ = true;
  } else if (mode_ == ProgressMode::kLog) {
    std::snprintf(line, sizeof(line),
                  "step %lld/%lld epoch %lld: loss %.4f, train accuracy %.1f%%, %.0f samples/s, "
                  "backward %.2f ms (comm wait %.2f ms), ETA %s\n",
                  static_cast<long long>(r.step), static_cast<long long>(r.total_steps),
                  static_cast<long long>(r.epoch), r.loss, 100.0 * r.train_accuracy,
                  r.samples_per_sec, r.backward_ms, r.comm_wait_ms,
                  format_duration(r.eta_s).c_str());
    std::fputs(line, stdout);
    std::fflush(stdout);
  }
}

void Progress::evaluation(int64_t step, double accuracy, int64_t samples, double loss) {
  if (!active_) return;
  const bool has_loss = std::isfinite(loss);
  if (metrics_) {
    nlohmann::json j = {{"event", "eval"},
                        {"step", step},
                        {"accuracy", round_to(accuracy, 6)},
                        {"samples", samples}};
    if (has_loss) {
      j["loss"] = round_to(loss, 6);
      j["perplexity"] = round_to(std::exp(loss), 6);
    }
    metrics_line(j.dump());
  }
  if (mode_ == ProgressMode::kNone) return;
  char line[200];
  if (has_loss) {
    std::snprintf(line, sizeof(line),
                  "eval after step %lld: held-out loss %.4f, perplexity %.3f, next-byte accuracy "
                  "%.2f%% on %lld windows",
                  static_cast<long long>(step), loss, std::exp(loss), 100.0 * accuracy,
                  static_cast<long long>(samples));
  } else {
    std::snprintf(line, sizeof(line), "eval after step %lld: accuracy %.2f%% on %lld test samples",
                  static_cast<long long>(step), 100.0 * accuracy, static_cast<long long>(samples));
  }
  note(line);
}

void Progress::note(const std::string& line) {
  if (!active_) return;
  end_bar_line();
  std::fputs((line + "\n").c_str(), stdout);
  std::fflush(stdout);
}

void Progress::finish() {
  if (active_) end_bar_line();
}

void Progress::end_bar_line() {
  if (!bar_open_) return;
  std::fputs("\n", stdout);
  std::fflush(stdout);
  bar_open_ = false;
}

void Progress::metrics_line(const std::string& json) {
  std::fputs((json + "\n").c_str(), metrics_);
  std::fflush(metrics_);
}

}  // namespace tdist::train
