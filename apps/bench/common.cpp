#include "apps/bench/common.h"

#include <spawn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
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
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) env.emplace_back(*e);
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
  // <build>/apps/bench/tdist-bench -> <source>/scripts/<name>
  const std::string rel = "/scripts/" + name;
  for (std::string dir = self_exe();;) {
    auto slash = dir.find_last_of('/');
    if (slash == std::string::npos || slash == 0) break;
    dir = dir.substr(0, slash);
    if (std::ifstream(dir + rel).good()) return dir + rel;
    if (std::ifstream(dir + "/.." + rel).good()) return dir + "/.." + rel;
  }
  return "scripts/" + name;
}

void report_error(const char* name, const std::exception& e) {
  std::cerr << name << ": " << e.what() << std::endl;
}

}  // namespace tdist::bench
