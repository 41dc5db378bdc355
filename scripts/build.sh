#!/usr/bin/env bash
# Set up (scripts/setup.sh), configure and build tdist into build/ (override with BUILD_DIR).
#   scripts/build.sh [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build}"
JOBS="${JOBS:-$(nproc)}"
scripts/setup.sh
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  # Library sources 8 to a translation unit: half the CPU time of a build from scratch
  # (TDIST_UNITY_LIBS in CMakeLists.txt; pass -DTDIST_UNITY_LIBS=0 to edit and rebuild one file).
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTDIST_UNITY_LIBS=8 "$@"
fi
cmake --build "$BUILD_DIR" -j "$JOBS"
