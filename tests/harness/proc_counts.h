#pragma once
// What this process holds, counted from /proc, for tests that check nothing is left behind:
//   dir_entries(dir, prefix): entries of `dir` whose names start with `prefix` (0 when `dir`
//                             cannot be read)
//   thread_count():           this process's threads (/proc/self/task)
//   fd_count():               its open descriptors (/proc/self/fd; the listing's own included)
//   held():                   all of these at once, with tdist's shared memory: the
//                             /dev/shm/tdist-<pid>-* files this process created (segments of
//                             other processes, such as tests running beside, are not counted)
//                             and its tdist-* mappings, memfds included (the leak tests compare
//                             it round after round)
//   symmetric_mappings():     this process's mappings of symmetric memory (comm's
//                             ProcessGroup::symmetric_empty), read-write and read-only
//   expect_rounds_leave_nothing(round): runs `round` four times; the first warms up what lives
//                             for the whole process (libtorch's pools, the logger) and must leave
//                             no tdist shared memory; rounds 2 to 4 must each end holding what
//                             the first ended with (a gtest failure naming the round otherwise)
#include <dirent.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <ostream>
#include <string>
#include <utility>

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
    return threads == o.threads && fds == o.fds && shm_files == o.shm_files &&
           shm_maps == o.shm_maps;
  }
};

inline std::ostream& operator<<(std::ostream& os, const Held& h) {
  return os << h.threads << " threads, " << h.fds << " descriptors, " << h.shm_files
            << " /dev/shm/tdist-<pid>-* files, " << h.shm_maps << " tdist-* mappings";
}

inline Held held() {
  Held h;
  h.threads = thread_count();
  h.fds = fd_count();
  h.shm_files = dir_entries("/dev/shm", "tdist-" + std::to_string(::getpid()) + "-");
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/tdist-") != std::string::npos ||
        line.find("/memfd:tdist-") != std::string::npos) {
      ++h.shm_maps;
    }
  }
  return h;
}

inline std::pair<int, int> symmetric_mappings() {
  std::ifstream maps("/proc/self/maps");
  int rw = 0, ro = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("memfd:tdist-symmetric") == std::string::npos) continue;
    rw += line.find(" rw-s ") != std::string::npos;
    ro += line.find(" r--s ") != std::string::npos;
  }
  return {rw, ro};
}

inline void expect_rounds_leave_nothing(const std::function<void()>& round) {
  round();
  const Held after_first = held();
  EXPECT_EQ(after_first.shm_files, 0) << after_first;
  EXPECT_EQ(after_first.shm_maps, 0) << after_first;
  for (int i = 2; i <= 4; ++i) {
    round();
    EXPECT_EQ(held(), after_first) << "round " << i;
  }
}

}  // namespace tdist::test
