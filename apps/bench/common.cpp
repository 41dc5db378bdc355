#include "apps/bench/common.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <stdexcept>

extern char** environ;

namespace tdist::bench {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string self_exe() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw std::runtime_error("cannot find this executable");
  return std::string(buf, static_cast<size_t>(n));
}

pid_t spawn_process(const std::vector<std::string>& args, const std::vector<std::string>& extra_env,
                    const std::string& what) {
  auto name_of = [](const std::string& entry) { return entry.substr(0, entry.find('=')); };
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    // An inherited variable that extra_env sets again is left out: with both, getenv() and
    // Python's os.environ would see the inherited one (the first), not ours.
    const std::string entry = *e;
    const bool replaced =
        std::any_of(extra_env.begin(), extra_env.end(),
                    [&](const std::string& x) { return name_of(x) == name_of(entry); });
    if (!replaced) env.push_back(entry);
  }
  env.insert(env.end(), extra_env.begin(), extra_env.end());
  std::vector<char*> argv, envp;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), envp.data());
  if (rc != 0) throw std::runtime_error("cannot start " + what + ": " + std::strerror(rc));
  return pid;
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  ::close(fd);
  if (!ok) throw std::runtime_error("cannot find a free port");
  return ntohs(addr.sin_port);
}

bool in_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "";
  for (size_t start = 0; start <= dirs.size();) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    const std::string dir = end > start ? dirs.substr(start, end - start) : ".";
    if (::access((dir + "/" + program).c_str(), X_OK) == 0) return true;
    start = end + 1;
  }
  return false;
}

std::string capture_output(const std::string& command, int* status) {
  FILE* p = ::popen(command.c_str(), "r");
  if (!p) throw std::runtime_error("cannot run " + command);
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  *status = ::pclose(p);
  return out;
}

std::string find_script(const std::string& name) {
  // Beside the binary (the build tree copies them there), or where `cmake --install` puts them.
  const std::string exe = self_exe();
  const std::string dir = exe.substr(0, exe.find_last_of('/'));
  const std::string places[] = {dir + "/" + name, dir + "/../share/tdist/scripts/" + name};
  for (const std::string& p : places) {
    if (std::ifstream(p).good()) return p;
  }
  TDIST_THROW(InvalidArgument, "tdist-bench: cannot find ", name, " beside ", exe, " (", places[0],
              ") nor where cmake --install puts it (", places[1],
              "); copy it there, or name it with --torch-script where the subcommand takes one");
}

void draw_plot(const std::string& python, const std::string& kind, const std::string& json_path,
               const std::string& png) {
  const std::string cmd = python + " " + find_script("plot_bench.py") + " " + kind + " '" +
                          json_path + "' -o '" + png + "' 2>&1";
  int status = 0;
  const std::string out = capture_output(cmd, &status);
  if (status != 0) throw std::runtime_error("plotting failed (" + cmd + "):\n" + out);
}

void report_error(const char* name, const std::exception& e) {
  std::cerr << name << ": " << e.what() << std::endl;
}

size_t parse_bytes(const std::string& text) {
  TDIST_CHECK_ARG(!text.empty(), "empty size");
  size_t mult = 1;
  std::string num = text;
  char last = static_cast<char>(std::toupper(text.back()));
  if (last == 'K' || last == 'M' || last == 'G') {
    mult = last == 'K' ? 1024 : last == 'M' ? 1024 * 1024 : 1024ull * 1024 * 1024;
    num = text.substr(0, text.size() - 1);
  }
  size_t pos = 0;
  unsigned long long v = 0;
  try {
    v = std::stoull(num, &pos);
  } catch (...) {
    pos = 0;
  }
  TDIST_CHECK_ARG(pos == num.size() && pos > 0, "size '", text,
                  "' is not a number with an optional K/M/G suffix");
  return static_cast<size_t>(v) * mult;
}

}  // namespace tdist::bench
