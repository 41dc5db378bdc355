#pragma once
// `tdist-bench collective`: an nccl-tests-style sweep of one collective over buffer sizes.
#include <CLI/CLI.hpp>

namespace tdist::bench {

// Adds the `collective` subcommand to `app`; it runs when the subcommand was parsed.
void add_collective_command(CLI::App& app);

}  // namespace tdist::bench
