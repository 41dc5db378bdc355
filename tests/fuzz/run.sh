#!/usr/bin/env bash
# The fuzz targets of tests/fuzz (libFuzzer, ASan, UBSan; clang):
#   run.sh build BUILD_DIR                   configure and build them in BUILD_DIR
#   run.sh run BUILD_DIR TARGET SECONDS      run fuzz_TARGET for SECONDS on a copy of its seed
#                                            corpus (tests/fuzz/corpus/<corpus>); new inputs stay
#                                            in BUILD_DIR, a crash leaves its input there too
# Exits 77 (ctest: skipped) when clang or its libFuzzer runtime is missing; non-zero on a finding.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mode=$1; build=$2
if ! command -v clang++ >/dev/null || ! echo 'int main(){}' |
     clang++ -x c++ -fsanitize=fuzzer-no-link -o /dev/null - 2>/dev/null; then
  echo "SKIP: clang++ with libFuzzer is not installed (scripts/setup.sh installs clang, libclang-rt-14-dev)"
  exit 77
fi
case "$mode" in
  build)
    cmake -S "$here" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=None >/dev/null
    # Every core: under ctest OMP_NUM_THREADS=1, which GNU nproc obeys.
    cmake --build "$build" -j "${JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"
    ;;
  run)
    target=$3; seconds=$4
    # The target's own seeds (corpus/store_server), else its family's (store_protocol -> store).
    corpus_name=$target
    [ -d "$here/corpus/$corpus_name" ] || corpus_name=${target%%_*}
    work="$build/corpus-$target"
    mkdir -p "$work"
    cp -n "$here/corpus/$corpus_name"/* "$work/"
    cd "$build"
    # -rss_limit_mb: an input that makes a decoder allocate what its bytes do not pay for fails.
    # -error_exitcode: libFuzzer's own default for a finding is 77, which ctest reads as "skipped".
    "./fuzz_$target" -max_total_time="$seconds" -rss_limit_mb=1024 -timeout=10 \
      -error_exitcode=1 -print_final_stats=1 "$work"
    ;;
  *) echo "usage: run.sh build|run BUILD_DIR [TARGET SECONDS]" >&2; exit 2 ;;
esac
