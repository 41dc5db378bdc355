#!/usr/bin/env bash
# Set up, build, and run the main job: a 2-process tdist job launched with tdist-run.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build}"
scripts/build.sh
exec "$BUILD_DIR/apps/tdist-run" --nproc-per-node 2 --master-port 0 "$BUILD_DIR/apps/tdist-hello"
