#include "tdist/rpc/detail/same_host.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "tdist/core/error.h"
#include "tdist/core/process_memory.h"

namespace tdist::rpc::detail {
namespace {

constexpr size_t kMaxFdsScanned = 1 << 16;

// An endpoint as /proc/net/tcp{,6} prints it: the address's 32-bit words in host order as
// %08X each, a colon, the port as %04X.
struct Endpoint {
  bool v6 = false;
  std::string text;
};

bool endpoint_of(const sockaddr_storage& ss, Endpoint* out) {
  char buf[64];
  if (ss.ss_family == AF_INET) {
    const auto& a = reinterpret_cast<const sockaddr_in&>(ss);
    uint32_t w;
    std::memcpy(&w, &a.sin_addr, 4);
    std::snprintf(buf, sizeof(buf), "%08X:%04X", w, ntohs(a.sin_port));
    *out = Endpoint{false, buf};
    return true;
  }
  if (ss.ss_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6&>(ss);
    uint32_t w[4];
    std::memcpy(w, &a.sin6_addr, 16);
    std::snprintf(buf, sizeof(buf), "%08X%08X%08X%08X:%04X", w[0], w[1], w[2], w[3],
                  ntohs(a.sin6_port));
    *out = Endpoint{true, buf};
    return true;
  }
  return false;
}

// The inode of the ESTABLISHED socket with this local and remote endpoint, created by `uid`;
// 0 when there is none.
uint64_t socket_inode(const Endpoint& local, const Endpoint& remote, uid_t uid, std::string* why) {
  std::ifstream in(local.v6 ? "/proc/net/tcp6" : "/proc/net/tcp");
  if (!in) {
    *why = "cannot read /proc/net/tcp";
    return 0;
  }
  std::string line;
  std::getline(in, line);  // the column names
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string sl, loc, rem, st, queues, timer, retr, owner, timeout, inode;
    f >> sl >> loc >> rem >> st >> queues >> timer >> retr >> owner >> timeout >> inode;
    if (loc != local.text || rem != remote.text) continue;
    if (st != "01") {
      *why = "the peer's socket is not established";
      return 0;
    }
    if (owner != std::to_string(uid)) {
      *why = "the peer's socket belongs to uid " + owner;
      return 0;
    }
    const uint64_t n = std::strtoull(inode.c_str(), nullptr, 10);
    if (n == 0) *why = "the peer's socket is not accepted yet";
    return n;
  }
  *why = "the peer's socket is not in this host's network namespace";
  return 0;
}

bool holds_socket(pid_t pid, uint64_t inode, std::string* why) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = ::opendir(dir.c_str());
  if (!d) {
    *why = str("cannot list ", dir, ": ", std::strerror(errno));
    return false;
  }
  const std::string want = "socket:[" + std::to_string(inode) + "]";
  bool found = false;
  size_t seen = 0;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    if (++seen > kMaxFdsScanned) break;
    char target[64];
    const std::string link = dir + "/" + e->d_name;
    ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    if (want == target) {
      found = true;
      break;
    }
  }
  ::closedir(d);
  if (!found) *why = str("process ", pid, " does not hold the peer's socket");
  return found;
}

}  // namespace

bool peer_is_local_process(int fd, pid_t pid, std::string* why) {
  std::string ignored;
  if (!why) why = &ignored;
  if (pid <= 0) {
    *why = "no process id";
    return false;
  }
  sockaddr_storage mine{}, theirs{};
  socklen_t a = sizeof(mine), b = sizeof(theirs);
  Endpoint local, remote;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &a) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&theirs), &b) != 0 ||
      !endpoint_of(mine, &local) || !endpoint_of(theirs, &remote)) {
    *why = "not a TCP connection";
    return false;
  }
  const uid_t uid = ::geteuid();
  // The peer's socket: its local end is our remote one and vice versa.
  const uint64_t inode = socket_inode(remote, local, uid, why);
  if (inode == 0) return false;
  struct stat st {};
  const std::string proc = "/proc/" + std::to_string(pid);
  if (::stat(proc.c_str(), &st) != 0 || st.st_uid != uid) {
    *why = str("process ", pid, " does not exist or runs as another user");
    return false;
  }
  if (!holds_socket(pid, inode, why)) return false;
  if (!can_read_process(pid)) {
    *why = str("the kernel does not let this process read process ", pid);
    return false;
  }
  return true;
}

}  // namespace tdist::rpc::detail
