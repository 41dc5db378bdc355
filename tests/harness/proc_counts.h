#pragma once
// What this process holds, counted from /proc, for tests that check nothing is left behind:
//   dir_entries(dir, prefix): entries of `dir` whose names start with `prefix` (0 when `dir`
//                             cannot be read)
//   thread_count():           this process's threads (/proc/self/task)
//   fd_count():               its open descriptors (/proc/self/fd; the listing's own included)
#include <dirent.h>

#include <string>

namespace tdist::test {

inline int dir_entries(const std::string& dir, const std::string& prefix = "") {
  int n = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != ".." && name.rfind(prefix, 0) == 0) ++n;
    }
    ::closedir(d);
  }
  return n;
}

inline int thread_count() { return dir_entries("/proc/self/task"); }
inline int fd_count() { return dir_entries("/proc/self/fd"); }

}  // namespace tdist::test
