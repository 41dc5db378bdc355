#pragma once
// What this process holds, counted from /proc, for tests that check nothing is left behind:
//   dir_entries(dir, prefix): entries of `dir` whose names start with `prefix` (0 when `dir`
//                             cannot be read)
//   thread_count():           this process's threads (/proc/self/task)
//   fd_count():               its open descriptors (/proc/self/fd; the listing's own included)
//   held():                   all of these at once, with tdist's shared memory: the
//                             /dev/shm/tdist-* files and the tdist-* mappings of this process
//                             (the leak tests compare it round after round)
#include <dirent.h>

#include <fstream>
#include <ostream>
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

struct Held {
  int threads = 0, fds = 0, shm_files = 0, shm_maps = 0;
  bool operator==(const Held& o) const {
    return threads == o.threads && fds == o.fds && shm_files == o.shm_files && shm_maps == o.shm_maps;
  }
};

inline std::ostream& operator<<(std::ostream& os, const Held& h) {
  return os << h.threads << " threads, " << h.fds << " descriptors, " << h.shm_files
            << " /dev/shm/tdist-* files, " << h.shm_maps << " tdist-* mappings";
}

inline Held held() {
  Held h;
  h.threads = thread_count();
  h.fds = fd_count();
  h.shm_files = dir_entries("/dev/shm", "tdist-");
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/tdist-") != std::string::npos) ++h.shm_maps;
  }
  return h;
}

}  // namespace tdist::test
