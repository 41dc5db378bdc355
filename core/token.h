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

// Note [Secure by default]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A port that listens beyond loopback without a token lets anyone who reaches it in: the store's
// keys, the mesh's collectives, RPC's registered functions. Every listener (the TCPStore server,
// the collective mesh, the RPC agent, and so the Python backend, whose groups are meshes) calls
// this with the address it is about to bind, decided by that address alone: a group over a
// HashStore or FileStore is covered as well as one over a TCPStore. Loopback needs no token: only
// this host's users reach it. Beyond loopback without a token it throws InvalidArgument naming
// `what`, the address and the ways out (TDIST_TOKEN, TDIST_TOKEN_FILE, the `option` field), unless
// TDIST_ALLOW_NO_TOKEN=1 (tdist-run --insecure); then it warns once per process and `what`, loudly.
// A wildcard address (0.0.0.0, ::) counts as beyond loopback. `allow_no_token`, when set (an
// Options field), wins over the variable.
void require_token_beyond_loopback(const std::string& what, bool has_token, const std::string& host,
                                   const char* option,
                                   std::optional<bool> allow_no_token = std::nullopt);

// `bytes` random bytes from the kernel (getrandom), as 2 * bytes lowercase hex digits: a fresh
// token, key or name no one else can guess.
std::string random_hex(size_t bytes);

}  // namespace tdist
