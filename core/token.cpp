#include "tdist/core/token.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>

#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tdist/core/logging.h"
#include "tdist/core/net/address.h"

namespace tdist {
namespace {

constexpr size_t kMaxTokenBytes = 4096;

std::string octal_mode(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

std::string read_token_file(const std::string& path) {
  const std::string what = "TDIST_TOKEN_FILE='" + path + "'";
  // O_NONBLOCK: a FIFO put in the file's place must not block the open; it is refused below.
  Fd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
  if (fd.get() < 0) {
    const int err = errno;
    throw InvalidArgument(
        str(what, ": cannot open the token file: ",
            err == ELOOP ? "it is a symbolic link (refused)" : std::strerror(err)));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    throw InvalidArgument(str(what, ": cannot stat the token file: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    throw InvalidArgument(str(what, " is not a regular file (mode ", octal_mode(st.st_mode), ")"));
  }
  if (st.st_mode & (S_IRGRP | S_IWGRP | S_IROTH | S_IWOTH)) {
    throw InvalidArgument(str(what, " has mode ", octal_mode(st.st_mode),
                              ": a token file must not be readable or writable by group or "
                              "others (chmod 600 it)"));
  }
  if (static_cast<uint64_t>(st.st_size) > kMaxTokenBytes) {
    throw InvalidArgument(
        str(what, " holds ", st.st_size, " bytes; a token has at most ", kMaxTokenBytes));
  }
  std::string token(kMaxTokenBytes + 1, '\0');
  size_t got = 0;
  while (got < token.size()) {
    ssize_t n = ::read(fd.get(), token.data() + got, token.size() - got);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      throw InvalidArgument(str(what, ": cannot read the token file: ", std::strerror(errno)));
    }
    got += static_cast<size_t>(n);
  }
  TDIST_CHECK_ARG(got <= kMaxTokenBytes, what, " grew past ", kMaxTokenBytes, " bytes");
  token.resize(got);
  if (!token.empty() && token.back() == '\n') token.pop_back();
  if (!token.empty() && token.back() == '\r') token.pop_back();
  TDIST_CHECK_ARG(!token.empty(), what, " is empty");
  return token;
}

Token load_token() {
  auto inline_token = env::get("TDIST_TOKEN");
  auto file = env::get("TDIST_TOKEN_FILE");
  TDIST_CHECK_ARG(!(inline_token && file),
                  "both TDIST_TOKEN and TDIST_TOKEN_FILE are set; set only one of them");
  if (inline_token) return Token{*inline_token, "TDIST_TOKEN"};
  if (file) return Token{read_token_file(*file), "TDIST_TOKEN_FILE=" + *file};
  return Token{};
}

Token resolve_token(const std::optional<std::string>& given, const char* option) {
  if (given) return Token{*given, option};
  return load_token();
}

std::string random_hex(size_t bytes) {
  std::string raw(bytes, '\0');
  size_t got = 0;
  while (got < bytes) {
    const ssize_t n = ::getrandom(raw.data() + got, bytes - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else {
      TDIST_CHECK(n < 0 && errno == EINTR, "getrandom: ", std::strerror(errno));
    }
  }
  static const char kDigits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * bytes);
  for (unsigned char b : raw) {
    hex += kDigits[b >> 4];
    hex += kDigits[b & 15];
  }
  return hex;
}

void require_token_beyond_loopback(const std::string& what, bool has_token, const std::string& host,
                                   const char* option, std::optional<bool> allow_no_token) {
  if (has_token || net::is_loopback_host(host)) return;
  const bool allowed =
      allow_no_token ? *allow_no_token : env::get_bool("TDIST_ALLOW_NO_TOKEN", false);
  TDIST_CHECK_ARG(allowed, what, " would listen on ", host,
                  ", beyond loopback, without a token: set TDIST_TOKEN or TDIST_TOKEN_FILE (or ",
                  option,
                  ") on every process of the job, or set TDIST_ALLOW_NO_TOKEN=1 "
                  "(tdist-run --insecure) to run without");
  static std::mutex mu;
  static std::set<std::string> said;  // one warning per process and listener kind
  std::lock_guard<std::mutex> lock(mu);
  if (!said.insert(what).second) return;
  TDIST_LOG_WARN(what, " listens on ", host,
                 " WITHOUT A TOKEN (TDIST_ALLOW_NO_TOKEN=1): anyone "
                 "who can reach it can connect as a member of the job");
}

}  // namespace tdist
