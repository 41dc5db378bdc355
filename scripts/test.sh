#!/usr/bin/env bash
# Set up, build, and run the tests (ctest). This is the README's test command and what CI runs.
#   scripts/test.sh           every tier: unit, slow, multiprocess, python, sanitize, fuzz
#   scripts/test.sh --quick   the unit tier only (the inner loop: a few minutes after a build)
#   scripts/test.sh -- ARGS   every tier, with ARGS passed on to ctest (e.g. -R Allreduce)
# Each test carries its tier as a ctest label and says how many of the cores it takes
# (PROCESSORS, tests/CMakeLists.txt): `ctest -j2` runs two single-core tests at once (unit and
# slow cases, the fuzz runs) and everything else alone. The end prints each tier's time.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build}"
labels=()
if [ "${1:-}" = "--quick" ]; then
  labels=(-L '^unit$')
  shift
fi
[ "${1:-}" = "--" ] && shift
start=$(date +%s)
scripts/build.sh
built=$(date +%s)
cd "$BUILD_DIR"
status=0
OMP_NUM_THREADS=1 ctest --output-on-failure --timeout 600 -j "${CTEST_JOBS:-$(nproc)}" \
  "${labels[@]}" "$@" || status=$?
end=$(date +%s)
echo "scripts/test.sh: set-up and build $((built - start)) s, tests $((end - built)) s" \
     "(each tier's time: ctest's Label Time Summary above)"
exit $status
