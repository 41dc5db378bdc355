// tdist-bench-ddp; see bench_ddp.h.
#include "apps/bench_ddp/bench_ddp.h"

int main(int argc, char** argv) { return tdist::bench::run_ddp_bench(argc, argv); }
