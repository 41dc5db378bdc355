#pragma once
// The job's shared secret, from the environment. One loader for every port that authenticates
// its peers with the connection handshake (core/net/handshake.h: the store, the collective mesh
// and RPC); libtorch-free, so the launcher can use it too.
//
//   TDIST_TOKEN=<secret>          the token itself
//   TDIST_TOKEN_FILE=<path>       a regular file holding it (one line; a trailing newline is
//                                 dropped), owned by anyone but readable and writable by its
//                                 owner only: group or other permission bits are refused
//
// Both set is refused (which one was meant is not guessed); an empty variable counts as unset.
// Errors are InvalidArgument naming the variable, the path and, for a file, its mode.
// Thread safety: reads the environment and the file; safe to call from any thread that does
// not change the environment meanwhile.

#include <optional>
#include <string>

namespace tdist {

struct Token {
  std::string value;   // empty: no token configured
  std::string source;  // "TDIST_TOKEN", "TDIST_TOKEN_FILE=<path>", or empty
};

// The token from TDIST_TOKEN or TDIST_TOKEN_FILE; an empty Token when neither is set.
Token load_token();

// The token given in code (`given`, its source named `option`), else load_token().
Token resolve_token(const std::optional<std::string>& given, const char* option);

// Reads a token file (see above): opened with O_NOFOLLOW (a symbolic link is refused), must be
// a regular file without group/other read or write permission, at most 4 KiB, not empty.
std::string read_token_file(const std::string& path);

// `bytes` random bytes from the kernel (getrandom), as 2 * bytes lowercase hex digits: a fresh
// token, key or name no one else can guess.
std::string random_hex(size_t bytes);

}  // namespace tdist
