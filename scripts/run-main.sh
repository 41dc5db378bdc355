#!/usr/bin/env bash
# Set up, build, and run the main job: tdist-train on 2 processes launched by tdist-run, one
# epoch of data-parallel training of a 784-1024-1024-1024-10 MLP on the synthetic dataset
# (about a minute on 2 cores). The loss falls and the test accuracy rises in the log; the run's
# summary (throughput, final loss, accuracy) is written to $BUILD_DIR/main-job-summary.json.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build}"
scripts/build.sh
exec "$BUILD_DIR/apps/tdist-run" --nproc-per-node 2 --master-port 0 \
  "$BUILD_DIR/apps/tdist-train" --dataset synthetic --model mlp --hidden 1024 --layers 3 \
  --epochs 1 --batch-size 64 --optimizer sgd --lr 0.05 --seed 0 \
  --log-every 25 --eval-every 100 --summary "$BUILD_DIR/main-job-summary.json"
