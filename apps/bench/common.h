#pragma once
// What every tdist-bench subcommand shares: the median, timing a call many times, starting a copy
// of this binary or another program, running a command and reading its output, drawing a plot
// of a result, and the guard that turns an exception into the subcommand's error line and exit
// code 1 (2 for a bad argument).

#include <sys/types.h>

#include <chrono>
#include <exception>
#include <string>
#include <vector>

#include "tdist/core/error.h"

namespace tdist::bench {

// The upper median (v[n/2] after sorting), as every table of tdist-bench reports. v not empty.
double median(std::vector<double> v);

// Runs step(i) for i in [0, warmup) untimed, then for i in [0, iters) timed; returns the seconds
// each timed call took.
template <class Step>
std::vector<double> time_calls(int warmup, int iters, Step&& step) {
  using Clock = std::chrono::steady_clock;
  for (int i = 0; i < warmup; ++i) step(i);
  std::vector<double> seconds;
  seconds.reserve(iters > 0 ? static_cast<size_t>(iters) : 0);
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    step(i);
    seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return seconds;
}

// The path of this executable (/proc/self/exe); std::runtime_error when it cannot be read.
std::string self_exe();

// Starts args[0] (looked up in PATH unless it has a slash) with args, in this process's
// environment with extra_env ("NAME=value") set over it; returns its pid. std::runtime_error naming `what`
// when it cannot be started.
pid_t spawn_process(const std::vector<std::string>& args, const std::vector<std::string>& extra_env,
                    const std::string& what);

// A TCP port on 127.0.0.1 that was free a moment ago (the kernel picked it).
int free_port();

// Whether an executable `program` is in one of the directories of PATH.
bool in_path(const std::string& program);

// Runs `command` through the shell and returns everything it wrote on stdout; its wait status
// in *status. std::runtime_error when it cannot be started.
std::string capture_output(const std::string& command, int* status);

// The path of the Python script `name` that tdist-bench runs (its anchors, its plots): beside
// this executable (the build copies them there) or in <prefix>/share/tdist/scripts (where
// `cmake --install` puts them, beside <prefix>/bin). InvalidArgument naming both places when
// neither has it: the build machine's source tree is never assumed.
std::string find_script(const std::string& name);

// Draws `json_path` (what a subcommand wrote with --json) as a PNG at `png` with
// scripts/plot_bench.py: `python plot_bench.py kind json_path -o png`. std::runtime_error with
// the script's output when it fails.
void draw_plot(const std::string& python, const std::string& kind, const std::string& json_path,
               const std::string& png);

// A byte count with an optional K/M/G suffix (powers of 1024): "4K" is 4096. InvalidArgument
// naming `text` when it is not one.
size_t parse_bytes(const std::string& text);

// Prints "<name>: <what>" on stderr.
void report_error(const char* name, const std::exception& e);

// Runs body() and returns what it returns; an exception becomes report_error() and 1, or 2 for
// InvalidArgument (a bad flag value).
template <class Body>
int run_or_report(const char* name, Body&& body) {
  try {
    return body();
  } catch (const InvalidArgument& e) {
    report_error(name, e);
    return 2;
  } catch (const std::exception& e) {
    report_error(name, e);
    return 1;
  }
}

}  // namespace tdist::bench
