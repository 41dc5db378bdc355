// tdist-bench fsdp: sharded data parallel training side by side in one run, on one model (the
// byte-level GPT of tdist-train --model gpt; 4 blocks of width 256, context 128: 3.3M
// parameters), one batch size, Adam, CPU:
//   PyTorch DDP over gloo, PyTorch FSDP2 (fully_shard) over gloo and over tdist's c10d backend
//     (scripts/bench_fsdp_torch.py, each rank a Python process),
//   tdist DDP and tdist fsdp (tdist-train --strategy ddp|fsdp, each rank a process).
// For each: samples/s, the loss (mean over the last --loss-window steps and the ranks), and per
// rank (the largest over the ranks) the parameters + gradients + Adam state after the last step,
// the peak of CPU tensor bytes (the counting allocator of core/cpu_memory.h on both sides: from
// the model's construction on, less what was held just before) and the peak resident set. Then
// the ratios the targets of issue 42 name, each marked met or NOT MET. No libtorch here: the
// work runs in the child processes.
#include <dirent.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "apps/bench/common.h"
#include "apps/bench/subcommands.h"
#include "tdist/core/error.h"

extern char** environ;

namespace tdist::bench {
namespace fsdp_bench {  // see collective.cpp
namespace {

struct Config {
  int world = 2;
  int layers = 4;
  int width = 256;
  int heads = 4;
  int context = 128;
  int batch = 8;
  int steps = 60;
  int warmup = 10;
  int loss_window = 10;
  double lr = 1e-3;
  int threads = 1;
  int rounds = 1;
  double timeout_s = 300;
  std::string data_dir;
  std::string python = "python3";
  std::string torch_script;  // empty: find_script("bench_fsdp_torch.py")
  std::string train_bin;     // empty: tdist-train beside this binary or in the build tree
  bool compare_torch = true;
  std::string json_file;
};

// One implementation's figures (per rank: the largest over the ranks).
struct Figures {
  double samples_per_s = 0;
  double loss = 0;
  double state_bytes = 0;           // parameters + gradients + optimizer state after the run
  double peak_allocated_bytes = 0;  // peak of counted CPU tensor bytes during the run
  double peak_rss_bytes = 0;
  double activation_bytes = 0;  // the most one step's forward and loss added (held at backward)
};

std::string dir_of(const std::string& path) { return path.substr(0, path.find_last_of('/')); }

bool is_file(const std::string& path) { return ::access(path.c_str(), X_OK) == 0; }

// tdist-train: --train, else beside this binary (installed: both in bin/), else in the build
// tree (<build>/apps/tdist-train, above apps/bench/).
std::string find_train(const Config& c) {
  if (!c.train_bin.empty()) {
    TDIST_CHECK_ARG(is_file(c.train_bin), "--train ", c.train_bin, " is not an executable");
    return c.train_bin;
  }
  const std::string dir = dir_of(self_exe());
  for (const std::string& p : {dir + "/tdist-train", dir + "/../tdist-train"}) {
    if (is_file(p)) return p;
  }
  TDIST_THROW(InvalidArgument, "cannot find tdist-train beside ", self_exe(), " nor in ", dir,
              "/..; name it with --train");
}

// Where the tdist_c10d module lies in the build tree (<build>/python), to put on PYTHONPATH; ""
// when it is not there (installed: Python finds it in its site-packages).
std::string c10d_module_dir() {
  const std::string dir = dir_of(self_exe()) + "/../../python";
  std::string found;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      if (std::string(e->d_name).rfind("tdist_c10d", 0) == 0) found = dir;
    }
    ::closedir(d);
  }
  return found;
}

std::string temp_path(const std::string& what) {
  char tmpl[] = "/tmp/tdist-bench-fsdp-XXXXXX";
  const int fd = ::mkstemp(tmpl);
  TDIST_CHECK(fd >= 0, "mkstemp failed for ", what);
  ::close(fd);
  return tmpl;
}

std::string read_all(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Starts `args` with `env` set over this process's environment, its stdout and stderr to `log`.
pid_t spawn_logged(const std::vector<std::string>& args, const std::vector<std::string>& env,
                   const std::string& log) {
  std::vector<std::string> all;
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    if (std::none_of(env.begin(), env.end(),
                     [&](const std::string& x) { return x.substr(0, x.find('=')) == name; })) {
      all.push_back(entry);
    }
  }
  all.insert(all.end(), env.begin(), env.end());
  std::vector<char*> argv, envp;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : all) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = 0;
  const int rc = ::posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  TDIST_CHECK(rc == 0, "cannot start ", args[0], ": ", std::strerror(rc));
  return pid;
}

// tdist-train --strategy `strategy` as c.world processes on 127.0.0.1; its summary's figures.
Figures run_tdist(const Config& c, const std::string& train, const std::string& strategy) {
  const std::string summary = temp_path("the summary");
  const int port = free_port();
  std::vector<std::string> args{train,
                                "--model",
                                "gpt",
                                "--layers",
                                std::to_string(c.layers),
                                "--width",
                                std::to_string(c.width),
                                "--heads",
                                std::to_string(c.heads),
                                "--context",
                                std::to_string(c.context),
                                "--batch-size",
                                std::to_string(c.batch),
                                "--steps",
                                std::to_string(c.warmup + c.steps),
                                "--warmup-steps",
                                std::to_string(c.warmup),
                                "--optimizer",
                                "adam",
                                "--lr",
                                std::to_string(c.lr),
                                "--threads",
                                std::to_string(c.threads),
                                "--strategy",
                                strategy,
                                "--progress",
                                "none",
                                "--log-every",
                                std::to_string(c.loss_window),
                                "--test-samples",
                                "8",
                                "--eval-batch-size",
                                "8",
                                "--timeout",
                                std::to_string(c.timeout_s),
                                "--summary",
                                summary};
  if (!c.data_dir.empty()) {
    args.push_back("--data-dir");
    args.push_back(c.data_dir);
  }
  std::vector<pid_t> pids;
  std::vector<std::string> logs;
  for (int r = 0; r < c.world; ++r) {
    logs.push_back(temp_path("a log"));
    pids.push_back(spawn_logged(
        args,
        {"RANK=" + std::to_string(r), "LOCAL_RANK=" + std::to_string(r),
         "WORLD_SIZE=" + std::to_string(c.world), "LOCAL_WORLD_SIZE=" + std::to_string(c.world),
         "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port),
         "OMP_NUM_THREADS=" + std::to_string(c.threads)},
        logs.back()));
  }
  std::string failed;
  for (int r = 0; r < c.world; ++r) {
    int status = 0;
    ::waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      failed += "\n--- rank " + std::to_string(r) + " (" +
                (WIFEXITED(status) ? "exit " + std::to_string(WEXITSTATUS(status))
                                   : "signal " + std::to_string(WTERMSIG(status))) +
                ") ---\n" + read_all(logs[r]);
    }
  }
  for (const auto& l : logs) std::remove(l.c_str());
  const std::string text = read_all(summary);
  std::remove(summary.c_str());
  TDIST_CHECK(failed.empty(), "tdist-train --strategy ", strategy, " failed:", failed);
  const auto s = nlohmann::json::parse(text);
  Figures f;
  f.samples_per_s = s.at("samples_per_sec").get<double>();
  f.loss = s.at("final_loss").get<double>();
  for (const auto& m : s.at("memory_per_rank")) {
    const double state = m.at("parameter_bytes").get<double>() +
                         m.at("gradient_bytes").get<double>() +
                         m.at("optimizer_state_bytes").get<double>();
    f.state_bytes = std::max(f.state_bytes, state);
    f.peak_allocated_bytes =
        std::max(f.peak_allocated_bytes, m.at("peak_allocated_bytes").get<double>());
    f.peak_rss_bytes = std::max(f.peak_rss_bytes, m.at("peak_rss_bytes").get<double>());
    f.activation_bytes = std::max(f.activation_bytes, m.at("activation_bytes").get<double>());
  }
  return f;
}

// scripts/bench_fsdp_torch.py: PyTorch's `strategy` (fsdp: FSDP2; ddp) over `backend`.
Figures run_torch(const Config& c, const std::string& strategy, const std::string& backend) {
  std::ostringstream cmd;
  const std::string module_dir = c10d_module_dir();
  if (!module_dir.empty()) cmd << "PYTHONPATH='" << module_dir << "'${PYTHONPATH:+:$PYTHONPATH} ";
  cmd << c.python << " '" << c.torch_script << "' --strategy " << strategy << " --backend "
      << backend << " --world-size " << c.world << " --layers " << c.layers << " --width "
      << c.width << " --heads " << c.heads << " --context " << c.context << " --batch " << c.batch
      << " --steps " << c.steps << " --warmup " << c.warmup << " --loss-window " << c.loss_window
      << " --lr " << c.lr << " --threads " << c.threads << " --timeout " << c.timeout_s;
  if (!c.data_dir.empty()) cmd << " --data-dir '" << c.data_dir << "'";
  cmd << " 2>&1";
  int status = 0;
  const std::string out = capture_output(cmd.str(), &status);
  std::istringstream lines(out);
  std::string line;
  nlohmann::json r;
  while (std::getline(lines, line)) {
    if (line.rfind("result ", 0) == 0) r = nlohmann::json::parse(line.substr(7));
  }
  TDIST_CHECK(status == 0 && r.is_object(), "PyTorch ", strategy, " over ", backend, " failed (",
              cmd.str(), "):\n", out);
  Figures f;
  f.samples_per_s = r.at("samples_per_s").get<double>();
  f.loss = r.at("loss").get<double>();
  for (const auto& m : r.at("ranks")) {
    f.state_bytes = std::max(f.state_bytes, m.at("state_bytes").get<double>());
    f.peak_allocated_bytes =
        std::max(f.peak_allocated_bytes, m.at("peak_allocated_bytes").get<double>());
    f.peak_rss_bytes = std::max(f.peak_rss_bytes, m.at("peak_rss_bytes").get<double>());
    f.activation_bytes = std::max(f.activation_bytes, m.at("activation_bytes").get<double>());
  }
  return f;
}

// Each figure's median over the rounds.
Figures median_of(const std::vector<Figures>& rs) {
  auto med = [&](double Figures::*field) {
    std::vector<double> v;
    for (const auto& r : rs) v.push_back(r.*field);
    return median(v);
  };
  return Figures{med(&Figures::samples_per_s),  med(&Figures::loss),
                 med(&Figures::state_bytes),    med(&Figures::peak_allocated_bytes),
                 med(&Figures::peak_rss_bytes), med(&Figures::activation_bytes)};
}

std::string mb(double bytes) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(1) << bytes / 1e6;
  return s.str();
}

}  // namespace
}  // namespace fsdp_bench

int run_fsdp_bench(int argc, char** argv) {
  using namespace fsdp_bench;
  Config c;
  CLI::App app{
      "tdist-bench fsdp: sharded data parallel side by side in one run: PyTorch DDP and "
      "FSDP2 (fully_shard) over gloo, FSDP2 over tdist's c10d backend, tdist DDP and "
      "tdist fsdp (tdist-train), on tdist-train's byte-level GPT with Adam on CPU. "
      "Samples/s, loss, and per rank the parameters + gradients + Adam state, the peak "
      "of CPU tensor bytes and the peak RSS; the ratios issue 42 targets."};
  app.add_option("--world-size", c.world, "ranks of every run")->check(CLI::Range(1, 64));
  app.add_option("--layers", c.layers, "gpt blocks")->check(CLI::Range(1, 256));
  app.add_option("--width", c.width, "gpt width (a multiple of --heads)")
      ->check(CLI::Range(1, 65536));
  app.add_option("--heads", c.heads, "attention heads")->check(CLI::Range(1, 1024));
  app.add_option("--context", c.context, "bytes per sequence")->check(CLI::Range(1, 1 << 20));
  app.add_option("--batch", c.batch, "sequences per rank and step")->check(CLI::Range(1, 1 << 20));
  app.add_option("--steps", c.steps, "timed steps per run")->check(CLI::Range(1, 1000000));
  app.add_option("--warmup", c.warmup, "untimed steps first")->check(CLI::Range(0, 1000000));
  app.add_option("--loss-window", c.loss_window,
                 "the loss reported: mean over the last this many steps (divides --steps and "
                 "--warmup + --steps)")
      ->check(CLI::Range(1, 1000000));
  app.add_option("--lr", c.lr, "Adam's learning rate")->check(CLI::PositiveNumber);
  app.add_option("--threads", c.threads, "intra-op threads per rank")->check(CLI::Range(1, 256));
  app.add_option("--rounds", c.rounds, "rounds, alternating the order; medians are reported")
      ->check(CLI::Range(1, 100));
  app.add_option("--timeout", c.timeout_s,
                 "seconds a run's collectives (and a Python run) may take")
      ->check(CLI::Range(1.0, 86400.0));
  app.add_option("--data-dir", c.data_dir,
                 "the text (*.py files; default: tdist-train's, the "
                 "newest /usr/lib/python3.N)");
  app.add_option("--python", c.python, "Python with torch (and tdist_c10d importable)");
  app.add_option("--torch-script", c.torch_script, "path of bench_fsdp_torch.py");
  app.add_option("--train", c.train_bin, "path of tdist-train");
  app.add_flag("!--no-torch", c.compare_torch, "run tdist's two only");
  app.add_option("--json", c.json_file, "also write the results as JSON to this file");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return run_or_report("tdist-bench fsdp", [&] {
    TDIST_CHECK_ARG(c.width % c.heads == 0, "--width ", c.width, " is not a multiple of --heads ",
                    c.heads);
    TDIST_CHECK_ARG((c.warmup + c.steps) % c.loss_window == 0 && c.steps >= c.loss_window,
                    "--loss-window ", c.loss_window, " must divide --warmup + --steps (",
                    c.warmup + c.steps, ") and be at most --steps");
    const std::string train = find_train(c);
    if (c.compare_torch && c.torch_script.empty())
      c.torch_script = find_script("bench_fsdp_torch.py");
    // Parameters of the model (models.h): embeddings, blocks, final LayerNorm, head.
    const double w = c.width;
    const double psi = 256 * w + c.context * w + 2 * w + 256 * w +
                       c.layers * (4 * w + (3 * w * w + 3 * w) + (w * w + w) + (4 * w * w + 4 * w) +
                                   (4 * w * w + w));
    std::cout << "model gpt " << c.layers << "x" << c.width << " h" << c.heads << " ctx"
              << c.context << " (" << static_cast<int64_t>(psi) << " parameters), batch " << c.batch
              << " per rank, Adam lr " << c.lr << ", CPU, world " << c.world << ", " << c.threads
              << " thread(s) per rank; " << c.steps << " timed steps (+" << c.warmup
              << " warm-up), median of " << c.rounds << " round(s)\n"
              << "loss: mean of the last " << c.loss_window << " steps over the ranks (PyTorch's "
              << "and tdist's draw their windows differently: compare within a side)\n"
              << "per rank (the largest over the ranks): state = parameters + gradients + Adam "
                 "state after the run; peak = most bytes of CPU tensors held at once from the "
                 "model's construction on (counting allocator, both sides); RSS = peak resident "
                 "set (Python's includes the interpreter); act = activations: the most bytes one "
                 "step's forward and loss added (held when its backward began)\n\n";
    struct Impl {
      std::string name;
      std::function<Figures()> run;
      std::vector<Figures> results;
    };
    std::vector<Impl> impls;
    if (c.compare_torch) {
      impls.push_back({"PyTorch DDP (gloo)", [&] { return run_torch(c, "ddp", "gloo"); }, {}});
      impls.push_back({"PyTorch FSDP2 (gloo)", [&] { return run_torch(c, "fsdp", "gloo"); }, {}});
      impls.push_back(
          {"PyTorch FSDP2 (tdist backend)", [&] { return run_torch(c, "fsdp", "tdist"); }, {}});
    }
    impls.push_back({"tdist DDP (ring)", [&] { return run_tdist(c, train, "ddp"); }, {}});
    impls.push_back({"tdist fsdp (ring)", [&] { return run_tdist(c, train, "fsdp"); }, {}});
    for (int r = 0; r < c.rounds; ++r) {
      for (size_t k = 0; k < impls.size(); ++k) {
        Impl& impl = impls[r % 2 == 0 ? k : impls.size() - 1 - k];
        std::cerr << "round " << r + 1 << ": " << impl.name << "\n";
        impl.results.push_back(impl.run());
      }
    }
    std::cout << std::left << std::setw(32) << "implementation" << std::right << std::setw(11)
              << "samples/s" << std::setw(10) << "loss" << std::setw(11) << "state MB"
              << std::setw(10) << "peak MB" << std::setw(9) << "RSS MB" << std::setw(9) << "act MB"
              << "\n";
    nlohmann::json report{{"world_size", c.world},
                          {"layers", c.layers},
                          {"width", c.width},
                          {"heads", c.heads},
                          {"context", c.context},
                          {"batch", c.batch},
                          {"steps", c.steps},
                          {"warmup", c.warmup},
                          {"rounds", c.rounds},
                          {"params", psi},
                          {"runs", nlohmann::json::object()}};
    std::map<std::string, Figures> fig;
    for (const Impl& impl : impls) {
      const Figures f = median_of(impl.results);
      fig[impl.name] = f;
      std::cout << std::left << std::setw(32) << impl.name << std::right << std::fixed
                << std::setw(11) << std::setprecision(1) << f.samples_per_s << std::setw(10)
                << std::setprecision(4) << f.loss << std::setw(11) << mb(f.state_bytes)
                << std::setw(10) << mb(f.peak_allocated_bytes) << std::setw(9)
                << mb(f.peak_rss_bytes) << std::setw(9) << mb(f.activation_bytes) << "\n";
      report["runs"][impl.name] = {
          {"samples_per_s", f.samples_per_s},   {"loss", f.loss},
          {"state_bytes", f.state_bytes},       {"peak_allocated_bytes", f.peak_allocated_bytes},
          {"peak_rss_bytes", f.peak_rss_bytes}, {"activation_bytes", f.activation_bytes}};
    }
    std::cout << "\ntargets (issue 42):\n";
    nlohmann::json targets = nlohmann::json::array();
    auto target = [&](const std::string& what, double value, const std::string& bound, bool met) {
      std::cout << "  " << std::left << std::setw(64) << what << std::right << std::fixed
                << std::setprecision(3) << std::setw(8) << value << "  " << bound << ": "
                << (met ? "met" : "NOT MET") << "\n";
      targets.push_back({{"target", what}, {"value", value}, {"bound", bound}, {"met", met}});
    };
    const Figures& ours = fig["tdist fsdp (ring)"];
    const Figures& ddp = fig["tdist DDP (ring)"];
    if (c.compare_torch) {
      const Figures& g = fig["PyTorch FSDP2 (gloo)"];
      const Figures& t = fig["PyTorch FSDP2 (tdist backend)"];
      const bool gloo_faster = g.samples_per_s >= t.samples_per_s;
      const Figures& best = gloo_faster ? g : t;
      const std::string best_name = gloo_faster ? "FSDP2 (gloo)" : "FSDP2 (tdist backend)";
      target("tdist fsdp samples/s / the faster PyTorch " + best_name,
             ours.samples_per_s / best.samples_per_s, ">= 1.2",
             ours.samples_per_s >= 1.2 * best.samples_per_s);
      target("tdist fsdp peak tensor bytes / " + best_name + "'s",
             ours.peak_allocated_bytes / best.peak_allocated_bytes, "<= 1",
             ours.peak_allocated_bytes <= best.peak_allocated_bytes);
      const Figures& pddp = fig["PyTorch DDP (gloo)"];
      std::cout << "  (PyTorch FSDP2 loss - PyTorch DDP loss: gloo " << std::scientific
                << std::setprecision(2) << g.loss - pddp.loss << ", tdist backend "
                << t.loss - pddp.loss << std::fixed << ")\n";
    }
    target("tdist fsdp samples/s / tdist DDP's", ours.samples_per_s / ddp.samples_per_s, ">= 0.9",
           ours.samples_per_s >= 0.9 * ddp.samples_per_s);
    const double model_state = 16.0 * psi / c.world;
    target("tdist fsdp state bytes / 16 psi / N", ours.state_bytes / model_state, "within 10% of 1",
           std::abs(ours.state_bytes / model_state - 1) <= 0.1);
    // The activations, measured: what tdist DDP's forward and loss add (the bytes held when its
    // backward begins less those held before its forward; the largest over steps and ranks).
    // DDP's, not fsdp's own, which would count the root's gathered parameters too.
    const double model_peak = model_state + ddp.activation_bytes;
    const double peak_ratio = ours.peak_allocated_bytes / model_peak;
    target("tdist fsdp peak / (16 psi / N + tdist DDP's activations)", peak_ratio,
           "within 10% of 1", std::abs(peak_ratio - 1) <= 0.1);
    std::cout << "  (tdist fsdp loss - tdist DDP loss: " << std::scientific << std::setprecision(2)
              << ours.loss - ddp.loss << std::fixed << ")\n";
    report["targets"] = targets;
    if (!c.json_file.empty()) std::ofstream(c.json_file) << report.dump(1) << "\n";
    return 0;
  });
}

}  // namespace tdist::bench
