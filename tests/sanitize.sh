#!/usr/bin/env bash
# The unit tests of core, comm, rpc and ddp under AddressSanitizer and UBSan (ctest Sanitize.*;
# docs/reliability.md "Sanitizers"), in a build directory of their own:
#   sanitize.sh build SOURCE_DIR BUILD_DIR   configure with the asan preset's flags and build
#                                            the four test programs
#   sanitize.sh run BUILD_DIR MODULE         run tests/MODULE/tdist_MODULE_tests whole
# A sanitizer report fails the run (ASan stops at its first; UBSan is told to).
set -euo pipefail
mode=$1
case "$mode" in
  build)
    # Keep the flags in step with the asan preset (CMakePresets.json).
    cmake -S "$2" -B "$3" -G Ninja -DCMAKE_BUILD_TYPE=Debug \
      "-DCMAKE_CXX_FLAGS=-fsanitize=address,undefined -fno-omit-frame-pointer" \
      -DTDIST_SANITIZER_BUILD=ON >/dev/null
    cmake --build "$3" -j "${JOBS:-$(nproc)}" --target tdist_core_tests tdist_comm_tests \
      tdist_rpc_tests tdist_ddp_tests
    ;;
  run)
    # Leaks are not checked: libtorch keeps allocations for the life of the process.
    export ASAN_OPTIONS="detect_leaks=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
    export OMP_NUM_THREADS=1
    exec "$2/tests/$3/tdist_$3_tests"
    ;;
  *) echo "usage: sanitize.sh build SOURCE_DIR BUILD_DIR | run BUILD_DIR MODULE" >&2; exit 2 ;;
esac
