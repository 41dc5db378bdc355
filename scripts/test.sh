#!/usr/bin/env bash
# Set up, build, and run every test (ctest). This is the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build}"
scripts/build.sh
cd "$BUILD_DIR"
# One test at a time: multi-rank tests already use both cores.
OMP_NUM_THREADS=1 ctest --output-on-failure --timeout 600 -j "${CTEST_JOBS:-1}"
