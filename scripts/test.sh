#!/usr/bin/env bash
# Set up, build, and run the tests (ctest). This is the README's test command and what CI runs.
#   scripts/test.sh           every tier: unit, slow, multiprocess, python, sanitize, fuzz
#   scripts/test.sh --quick   the unit tier only (the inner loop: a few minutes after a build)
#   scripts/test.sh -- ARGS   every tier, with ARGS passed on to ctest (e.g. -R Allreduce)
# Each test carries its tier as a ctest label and says how many of the cores it takes
# (PROCESSORS, tests/CMakeLists.txt): `ctest -j2` runs two single-core tests at once (unit
# shards, the fuzz runs, the halves of a sanitizer run) and everything else alone. The unit
# tier runs as GoogleTest shards of about TDIST_TEST_SHARD_CASES cases (default 40; each case
# keeps its own time limit, tests/unit_shards.cmake) rather than one process per case, except
# when ctest ARGS are given (they name cases: one entry per case, as plain `ctest` has it). The
# end prints each tier's time and how many GoogleTest cases ran.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build}"
labels=()
if [ "${1:-}" = "--quick" ]; then
  labels=(-L '^unit$')
  shift
fi
[ "${1:-}" = "--" ] && shift
if [ $# -eq 0 ]; then
  export TDIST_TEST_SHARD_CASES="${TDIST_TEST_SHARD_CASES:-40}"
fi
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
# Every ctest entry that ran GoogleTest (a case, a shard, a sanitizer run) ends with its summary.
awk '/^\[==========\] [0-9]+ tests? from [0-9]+ test suites? ran/ { ran += $2; entries++ }
     /^\[  SKIPPED \] [0-9]+ tests?,/ { skipped += $4 }
     /^\[  FAILED  \] [0-9]+ tests?,/ { failed += $4 }
     END { printf "scripts/test.sh: %d GoogleTest cases ran in %d ctest entries (%d skipped, %d failed)\n",
                  ran, entries, skipped, failed }' Testing/Temporary/LastTest.log || true
# Last, where a CI log's tail shows it: each failed entry with the cases that failed in it, the
# first lines of each failure, and where a sanitizer report or a crash stopped a program; and
# the cases a sanitizer run found flaky (tests/sanitize.sh).
awk 'function cut(s) { return length(s) > 220 ? substr(s, 1, 220) "..." : s }
     /^[0-9]+\/[0-9]+ Testing: / { entry = $3; last = ""; cases = ""; msg = ""; more = 0; next }
     more > 0 { msg = msg "\n      " cut($0); more--; next }
     /^\[ RUN      \] / { last = $4 }
     /^\[  FAILED  \] .* \([0-9]+ ms\)$/ { c = $4; sub(/,$/, "", c); cases = cases " " c }
     /: Failure$/ && nfail < 4 { msg = msg "\n    " cut($0); more = 5; nfail++ }
     /SUMMARY: [A-Za-z]+Sanitizer/ { msg = msg "\n    " cut($0) " (in " last ")" }
     /^sanitize.sh: flaky under / { printf "scripts/test.sh: %s: %s\n", entry, $0 }
     /^Test Failed/ {
       printf "scripts/test.sh: FAILED %s:%s%s\n", entry,
              cases != "" ? cases : " (no case reported a failure; the last one started: " last ")", msg
     }' Testing/Temporary/LastTest.log || true
exit $status
