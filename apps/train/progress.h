#pragma once
// What rank 0 of tdist-train shows while it trains: a progress bar when stdout is a terminal
// (step, loss, accuracy, samples/s, ETA; redrawn in place), plain log lines otherwise, and
// optionally JSON lines in a metrics file (one per log point and one per evaluation).
//
// Not thread safe (the training loop drives it). Output goes to stdout, flushed per line.

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

namespace tdist::train {

enum class ProgressMode { kAuto, kBar, kLog, kNone };

// "auto", "bar", "log" or "none"; InvalidArgument otherwise.
ProgressMode parse_progress_mode(const std::string& s);

// Averages over the steps since the previous report (losses and accuracy across all ranks;
// times are rank 0's).
struct StepReport {
  int64_t step = 0;  // steps done
  int64_t total_steps = 0;
  int64_t epoch = 0;
  int64_t window_steps = 0;  // steps this report covers
  double loss = 0;
  double train_accuracy = 0;   // fraction in [0, 1]
  double samples_per_sec = 0;  // all ranks' samples
  double data_ms = 0;          // per step: producing the batch
  double forward_ms = 0;
  double backward_ms = 0;   // loss.backward(), including the final wait for communication
  double comm_wait_ms = 0;  // from the last gradient computed to the end of backward
  double optimizer_ms = 0;
  double elapsed_s = 0;  // since training started in this process
  double eta_s = -1;     // negative: unknown
};

class Progress {
 public:
  // `active` false (ranks other than 0): every call does nothing. Throws Error when the metrics
  // file cannot be opened (it is appended to, so a resumed run continues it).
  Progress(ProgressMode mode, bool active, const std::string& metrics_path);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void report(const StepReport& r);
  // `loss`: the mean cross-entropy per prediction (nats), reported with its perplexity when
  // finite (the language model; NaN leaves both out).
  void evaluation(int64_t step, double accuracy, int64_t samples, double loss);
  // A line of its own (the bar is ended first and redrawn at the next report).
  void note(const std::string& line);
  // Ends the bar's line.
  void finish();

  bool is_bar() const { return mode_ == ProgressMode::kBar; }

 private:
  void end_bar_line();
  void metrics_line(const std::string& json);

  const bool active_;
  ProgressMode mode_;
  std::FILE* metrics_ = nullptr;
  bool bar_open_ = false;  // a bar line without its newline is on the terminal
};

// "1:02:03", "4:05" (hours only when needed); "?" when negative.
std::string format_duration(double seconds);

}  // namespace tdist::train
