// tdist-bench: benchmarks a user runs under tdist-run. One subcommand per file:
//   collective  (bench_collective.cpp)  an nccl-tests-style table for one collective
#include <CLI/CLI.hpp>

#include <iostream>

#include "apps/bench/bench_collective.h"

int main(int argc, char** argv) {
  CLI::App app{"tdist-bench: benchmarks of tdist's collectives", "tdist-bench"};
  app.require_subcommand(1);
  tdist::bench::add_collective_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::cerr << "tdist-bench: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
