#!/usr/bin/env bash
# Set up, build, and run the main job: tdist-train on 2 processes launched by tdist-run, one
# epoch of data-parallel training of a small conv net on Fashion-MNIST (Debian's
# dataset-fashion-mnist, which setup installs; about a minute and a half on 2 cores). The loss
# falls and the test accuracy rises in the log; the run's summary (throughput, final loss,
# accuracy) is written to $BUILD_DIR/main-job-summary.json, its metrics (JSON lines) to
# $BUILD_DIR/main-job-metrics.jsonl, and their picture to $BUILD_DIR/main-job.png.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build}"
scripts/build.sh
rm -f "$BUILD_DIR/main-job-metrics.jsonl"
"$BUILD_DIR/apps/tdist-run" --nproc-per-node 2 --master-port 0 \
  "$BUILD_DIR/apps/tdist-train" --dataset fashion-mnist --model conv \
  --epochs 1 --batch-size 32 --optimizer adam --lr 0.002 --seed 0 \
  --log-every 100 --eval-every 400 --summary "$BUILD_DIR/main-job-summary.json" \
  --metrics "$BUILD_DIR/main-job-metrics.jsonl"
"${TDIST_PYTHON:-python3}" scripts/plot_metrics.py "$BUILD_DIR/main-job-metrics.jsonl" \
  -o "$BUILD_DIR/main-job.png" --title "tdist-train: conv net, Fashion-MNIST, 2 ranks, 1 epoch"
