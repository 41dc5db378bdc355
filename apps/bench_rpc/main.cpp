#include "apps/bench_rpc/bench_rpc.h"

int main(int argc, char** argv) { return tdist::bench::run_rpc_bench(argc, argv); }
